"""The example backend of docs/development.md beyond the conformance suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.example_backend import SQLiteFileBackend

ROOT = Path(__file__).resolve().parent.parent


def test_tokens_keep_growing_after_the_file_is_lost(tmp_path: Path) -> None:
    """A lost file (a restart that lost its data) must not reissue a token."""
    path = tmp_path / "locks.sqlite3"
    before = SQLiteFileBackend("example-lost", {"LOCATION": str(path)})
    first = before.acquire("x", renew=False)
    first.release()
    second = before.acquire("x", renew=False)
    second.release()
    before.close()
    path.unlink()
    after = SQLiteFileBackend("example-lost", {"LOCATION": str(path)})
    third = after.acquire("x", renew=False)
    third.release()
    after.close()
    assert first.token < second.token < third.token


@pytest.mark.multiprocess
def test_the_shipped_conformance_suite_passes_on_it(tmp_path: Path) -> None:
    """docs/development.md's one command: ``python -m django_dlock.testing`` on the example."""
    command = [
        sys.executable, "-m", "django_dlock.testing",
        "--backend", "tests.example_backend.SQLiteFileBackend",
        "--location", str(tmp_path / "locks.sqlite3"),
        "-q", "-x", "-p", "no:logging",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST_"))}
    run = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None, summary
    assert int(passed.group(1)) >= 50, summary
    assert "failed" not in summary and "error" not in summary, summary
