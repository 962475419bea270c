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
from django.db import connections

from django_dlock.backends.base import BaseLockBackend
from django_dlock.testing.plugin import backend_settings, conformance_backends

WIDTH = 12


def child_environment() -> dict[str, str]:
    """This environment, with this process's import path: the child imports what we do.

    The backend under test may live in the project that runs the suite (its
    directory on ``sys.path``, not installed); the child configures Django itself.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def run_workers(
    tmp_path: Path,
    *,
    processes: int,
    sections: int,
    use_lock: bool,
    databases: dict[str, Any],
    backend: dict[str, Any],
    hold: float,
    limit: int | None = None,
) -> list[tuple[int, int | None]]:
    counter = tmp_path / "counter"
    counter.write_text("0" * WIDTH)
    (tmp_path / "inside").write_text("0" * WIDTH)
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
            "limit": limit,
            "inside": str(tmp_path / "inside"),
            "ready": str(tmp_path / f"ready-{i}"),
        }
        env = {**child_environment(), "DLOCK_MP_CONFIG": json.dumps(config)}
        command = [sys.executable, "-m", "django_dlock.testing.mp_worker"]
        workers.append(subprocess.Popen(command, env=env))
    # Every worker at the start line (Django imported, the backend configured)
    # before any begins: on a loaded machine the imports take seconds, and a
    # worker that began early would run its sections alone.
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready-{i}").exists() for i in range(processes)):
        exited = [w.returncode for w in workers if w.poll() is not None]
        assert not exited, f"a worker exited before the start: {exited}"
        assert time.monotonic() < deadline, "the workers did not all get ready in 300 s"
        time.sleep(0.01)
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
    databases, entry = worker_settings(backend_alias)
    started = time.monotonic()
    records = run_workers(
        tmp_path,
        processes=processes,
        sections=sections,
        use_lock=True,
        databases=databases,
        backend=entry,
        hold=0.0005,
    )
    elapsed = time.monotonic() - started
    final = int((tmp_path / "counter").read_text())
    lost = processes * sections - final
    values = [value for value, _ in records]
    tokens = [token for _, token in records if token is not None]
    assert len(tokens) == len(records), "a section ran without its lease's token"
    inversions = sum(1 for a, b in itertools.pairwise(tokens) if not a < b)
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


def worker_settings(alias: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker's DATABASES and its "default" backend: those of ``alias`` here."""
    database = conformance_backends()[alias]
    entry = backend_settings(alias)
    if database is None:
        return {}, entry
    # The worker knows the tested database as its "default".
    entry.pop("OPTIONS", None)
    return database_settings(database), entry


@pytest.mark.multiprocess
def test_eight_processes_share_a_semaphore_of_three(
    backend_alias: str, backend: BaseLockBackend, tmp_path: Path
) -> None:
    """The section counts the processes inside it: never more than the limit."""
    if not backend.supports_multiprocess:
        pytest.skip(f"{type(backend).__name__} keeps its locks in one process's memory")
    if not backend.supports_semaphores:
        pytest.skip(f"backend {backend_alias!r} declares no supports_semaphores")
    databases, entry = worker_settings(backend_alias)
    records = run_workers(
        tmp_path, processes=8, sections=25, use_lock=True, databases=databases,
        backend=entry, hold=0.01, limit=3,
    )  # fmt: skip
    inside = [count for count, _ in records]
    tokens = [token for _, token in records]
    print(f"\n[{backend_alias}] 8 processes, limit 3: most inside at once = {max(inside)}")
    assert max(inside) <= 3
    assert max(inside) >= 2, "the semaphore never let two in: it acts as a mutex"
    assert len(set(tokens)) == len(tokens) == 200


@pytest.mark.multiprocess
def test_the_semaphore_control_lets_more_than_three_in(tmp_path: Path) -> None:
    """The same workload without the semaphore does exceed 3, so the test above can fail."""
    records = run_workers(
        tmp_path, processes=8, sections=10, use_lock=False, databases={},
        backend={"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}, hold=0.05, limit=3,
    )  # fmt: skip
    assert max(count for count, _ in records) > 3


HOLDER = """
import os, sys, time, django
from django.conf import settings
settings.configure(DATABASES=@DATABASES@, INSTALLED_APPS=["django_dlock"],
                   DLOCK_BACKENDS={"default": @BACKEND@}, USE_TZ=True)
django.setup()
from django_dlock import semaphore
held = semaphore(@NAME@, limit=1, ttl=@TTL@).acquire()
print(held.token, flush=True)
time.sleep(600)
"""


@pytest.mark.multiprocess
def test_a_killed_holder_frees_its_slot_within_the_ttl(
    backend_alias: str, backend: BaseLockBackend, name: str, tmp_path: Path
) -> None:
    if not backend.supports_multiprocess:
        pytest.skip(f"{type(backend).__name__} keeps its locks in one process's memory")
    if not backend.supports_semaphores:
        pytest.skip(f"backend {backend_alias!r} declares no supports_semaphores")
    from django_dlock import LockTimeout, semaphore

    databases, entry = worker_settings(backend_alias)
    ttl = max(2.0, backend.min_ttl)
    code = HOLDER.replace("@DATABASES@", repr(databases))
    code = code.replace("@BACKEND@", repr(entry))
    code = code.replace("@NAME@", repr(name)).replace("@TTL@", repr(ttl))
    env = child_environment()
    holder = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        token = int(holder.stdout.readline())
        with pytest.raises(LockTimeout):
            semaphore(name, limit=1, backend=backend_alias, timeout=0).acquire()
        holder.kill()
        holder.wait(10)
        killed = time.monotonic()
        with semaphore(name, limit=1, backend=backend_alias, timeout=ttl * 3) as held:
            waited = time.monotonic() - killed
        print(f"\n[{backend_alias}] slot freed {waited:.2f}s after kill -9 (ttl {ttl}s)")
        assert held.token > token
        assert waited <= ttl + backend.expiry_slack + 1.0
    finally:
        holder.kill()
        holder.wait(10)
