"""The realistic project (tests/realproject/) under load, and its own test run.

tests/realproject/load.py starts the project under uvicorn with a Celery
worker on RabbitMQ, on PostgreSQL with ATOMIC_REQUESTS on and off, with the
database and the Redis lock backends, and counts lost updates, connections
left open and 5xx answers down every path: guarded views (sync, async,
function and class), fenced saves of models with multi-table inheritance,
deletes, a lock held until a second database commits, and a locked task.
Each failure names its cell, its path and what was lost.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.servers import port_open

ROOT = Path(__file__).resolve().parent.parent
LOAD = ROOT / "tests" / "realproject" / "load.py"
CELLS = [(atomic, backend) for backend in ("db", "redis") for atomic in ("on", "off")]

pytestmark = pytest.mark.multiprocess


def _missing() -> str | None:
    if importlib.util.find_spec("uvicorn") is None:
        return "uvicorn is not installed (the dev dependency group has it)"
    if not port_open("127.0.0.1", 5432):
        return "PostgreSQL does not answer on 127.0.0.1:5432"
    if not port_open("127.0.0.1", 5672):
        return "RabbitMQ does not answer on 127.0.0.1:5672"
    return None


@pytest.fixture(scope="module", autouse=True)
def _servers() -> None:
    reason = _missing()
    if reason is None:
        return
    if os.environ.get("DLOCK_REQUIRE_ALL_BACKENDS") == "1":
        pytest.fail(f"{reason}, and DLOCK_REQUIRE_ALL_BACKENDS=1")
    pytest.skip(reason)


def _run_load(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, str(LOAD), "--json", str(out), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if not out.exists():
        pytest.fail(
            f"load.py exited {done.returncode} without results:\n{done.stdout}{done.stderr}"
        )
    results: dict[str, Any] = json.loads(out.read_text())
    results["output"] = done.stdout
    return results


@pytest.fixture(scope="module")
def load_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_load(tmp_path_factory.mktemp("realproject"), "--project-tests", "skip")


def test_manage_py_test_on_postgresql(tmp_path: Path) -> None:
    """The project's TestCases take locks; the run exits 0 and drops its test databases."""
    results = _run_load(tmp_path, "--project-tests", "only")
    assert not results["failures"], "\n".join(results["failures"])


@pytest.mark.parametrize(("atomic", "backend"), CELLS, ids=[f"atomic-{a}-{b}" for a, b in CELLS])
def test_load_loses_nothing_leaks_nothing(
    load_run: dict[str, Any], atomic: str, backend: str
) -> None:
    [cell] = [c for c in load_run["cells"] if (c["atomic"], c["backend"]) == (atomic, backend)]
    paths = {p["path"] for p in cell["paths"]}
    assert not cell["errors"], "\n".join(cell["errors"])
    assert paths >= {"view-fn", "async-fn", "save-book", "ledger-2db", "celery-task", "delete"}
    assert all(p["requests"] > 1 for p in cell["paths"]), load_run["output"]
    assert not cell["failures"], "\n".join(cell["failures"]) + "\n\n" + load_run["output"]
