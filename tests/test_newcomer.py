"""Run tests/newcomer/ in its own pytest session, with a newcomer's default settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_newcomer_suite_passes() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.newcomer.settings"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--ds=tests.newcomer.settings",
            "-q",
            str(ROOT / "tests" / "newcomer"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout
