"""Locked tasks of Django's task framework, for tests/test_django_tasks.py.

Run by ImmediateBackend in the test process, and by django-tasks-db's
``db_worker`` processes (``.using(backend="db")``), which import them from
here by their module path. Bodies append a line per run to the ``log`` file
they are given (``tests.tasks.record``), so a test counts the bodies that ran
in every process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

from django_dlock.task_framework import current_lock, locked_task
from tests.tasks import record, wait_for_file


def _body(key: str, log: str, go: str | None) -> int:
    held = current_lock()
    assert held is not None
    record(log, key=key, token=held.token, name=held.name)
    if go:
        wait_for_file(go)
    return int(held.token)


@locked_task
def bare(a: int, b: int = 2) -> int:
    return a + b


@locked_task(key="skip:{key}", backend="locmem", ttl=10)
def skipping(key: str, log: str) -> int:
    return _body(key, log, None)


@locked_task(key="raise:{key}", backend="locmem", on_locked="raise")
def raising(key: str, log: str) -> int:
    return _body(key, log, None)


@locked_task(key="wait:{key}", backend="locmem", on_locked="wait", timeout=10)
def waiting(key: str, log: str) -> int:
    return _body(key, log, None)


@locked_task(key="limit:{key}", backend="locmem", limit=2)
def limited(key: str, log: str) -> int:
    return _body(key, log, None)


@locked_task(key="queue:{key}", backend="locmem", scope="queue", ttl=10)
def queued(key: str, log: str) -> int:
    return _body(key, log, None)


@locked_task(backend="locmem")
def default_key(a: Any, b: Any = None) -> Any:
    return a


@locked_task(key="ctx:{key}", backend="locmem", takes_context=True)
def with_context(context: Any, key: str, log: str) -> str:
    _body(key, log, None)
    return str(context.task_result.id)


@locked_task(key="async:{key}", backend="locmem", scope="queue")
async def asynchronous(key: str, log: str) -> int:
    return _body(key, log, None)


_arrived: dict[str, Any] = {}


@locked_task(key="meet:{key}", backend="locmem")
async def rendezvous(key: str, log: str, count: int) -> int:
    """Wait (10 s at most) until ``count`` bodies of this log have started: they overlap."""
    import asyncio
    import time

    started = _arrived.setdefault(log, [])
    started.append(key)
    deadline = time.monotonic() + 10
    while len(started) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(started)} of {count} bodies ran at once")
        await asyncio.sleep(0.01)
    return _body(key, log, None)


# Run by db_worker processes: the lock is the database backend on the
# worker's database, which every process shares.
@locked_task(key="dedup:{key}", backend="db-sqlite", ttl=30)
def dedup(key: str, log: str, go: str | None = None) -> int:
    return _body(key, log, go)


@locked_task(key="dedup-q:{key}", backend="db-sqlite", ttl=30, scope="queue")
def dedup_queued(key: str, log: str, go: str | None = None) -> int:
    return _body(key, log, go)


@locked_task(key="short:{key}", backend="locmem", scope="queue", ttl=1)
def queued_briefly(key: str, log: str) -> int:
    return _body(key, log, None)


ImmediateBackend = import_string(settings.TASKS["default"]["BACKEND"])


@dataclass(frozen=True, slots=True, kw_only=True)
class OtherTask(ImmediateBackend.task_class):  # type: ignore[misc,name-defined]
    """A task class of its own, as some backends have."""


class OtherTaskBackend(ImmediateBackend):  # type: ignore[misc,valid-type]
    task_class = OtherTask
