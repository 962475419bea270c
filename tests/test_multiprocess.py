"""Mutual exclusion across real processes, with tokens checked against acquisition order."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connections

from django_dlock.backends.base import BaseLockBackend

WIDTH = 12
ROOT = Path(__file__).resolve().parent.parent


def run_workers(
    tmp_path: Path,
    *,
    processes: int,
    sections: int,
    use_lock: bool,
    databases: dict[str, Any],
    backend: dict[str, Any],
    hold: float,
) -> list[tuple[int, int | None]]:
    counter = tmp_path / "counter"
    counter.write_text("0" * WIDTH)
    start = tmp_path / "start"
    workers = []
    for i in range(processes):
        config = {
            "databases": databases,
            "backend": backend,
            "counter": str(counter),
            "start": str(start),
            "out": str(tmp_path / f"out-{i}.json"),
            "width": WIDTH,
            "sections": sections,
            "use_lock": use_lock,
            "hold": hold,
            "name": "mp:counter",
        }
        env = {**os.environ, "DLOCK_MP_CONFIG": json.dumps(config), "PYTHONPATH": str(ROOT)}
        env.pop("DJANGO_SETTINGS_MODULE", None)
        workers.append(subprocess.Popen([sys.executable, "-m", "tests.mp_worker"], env=env))
    time.sleep(1.0)  # let every worker import Django and reach the start line
    start.touch()
    for worker in workers:
        assert worker.wait(timeout=600) == 0
    records: list[tuple[int, int | None]] = []
    for i in range(processes):
        records.extend(tuple(r) for r in json.loads((tmp_path / f"out-{i}.json").read_text()))
    assert len(records) == processes * sections
    return sorted(records, key=lambda r: r[0])


def database_settings(alias: str) -> dict[str, Any]:
    s = connections[alias].settings_dict
    keys = ("ENGINE", "NAME", "HOST", "PORT", "USER", "PASSWORD", "OPTIONS")
    return {"default": {k: s[k] for k in keys if k in s}}


@pytest.mark.multiprocess
def test_eight_processes_lose_no_updates(
    backend_alias: str, backend: BaseLockBackend, tmp_path: Path
) -> None:
    if not backend.supports_multiprocess:
        pytest.skip(f"{type(backend).__name__} keeps its locks in one process's memory")
    processes, sections = 8, 200
    database = settings.CONFORMANCE_BACKENDS[backend_alias]
    backend_settings = dict(settings.DLOCK_BACKENDS[backend_alias])
    if database is not None:
        # The worker knows the tested database as its "default".
        backend_settings.pop("OPTIONS", None)
    started = time.monotonic()
    records = run_workers(
        tmp_path,
        processes=processes,
        sections=sections,
        use_lock=True,
        databases=database_settings(database) if database else {},
        backend=backend_settings,
        hold=0.0005,
    )
    elapsed = time.monotonic() - started
    final = int((tmp_path / "counter").read_text())
    lost = processes * sections - final
    values = [value for value, _ in records]
    tokens = [token for _, token in records]
    inversions = sum(1 for a, b in itertools.pairwise(tokens) if not a < b)  # type: ignore[operator]
    print(
        f"\n[{backend_alias}] {processes} processes x {sections} sections: "
        f"counter={final}, lost updates={lost}, token order inversions={inversions}, "
        f"{elapsed:.1f}s"
    )
    assert lost == 0
    assert values == list(range(processes * sections)), "two sections read the same value"
    assert inversions == 0, "fencing tokens must increase in acquisition order"


@pytest.mark.multiprocess
def test_without_the_lock_updates_are_lost(tmp_path: Path) -> None:
    """The control: the same workload unguarded does lose updates, so the test above can fail."""
    processes, sections = 4, 50
    run_workers(
        tmp_path,
        processes=processes,
        sections=sections,
        use_lock=False,
        databases={},
        backend={"BACKEND": "django_dlock.backends.locmem.LocMemBackend"},
        hold=0.002,
    )
    final = int((tmp_path / "counter").read_text())
    lost = processes * sections - final
    print(f"\n[no lock] {processes} x {sections}: counter={final}, lost={lost}")
    assert final < processes * sections
