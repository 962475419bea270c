"""Locked tasks for tests/test_celery*.py, run eagerly and by real workers.

Each task appends one JSON line per body run to the ``log`` file it is given
(small appends to one file do not interleave), so a test can count the
bodies that ran across processes. ``go``: a file the body waits for, so that
duplicates arrive while it still holds its lock.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery.exceptions import Ignore, Reject

from django_dlock import locks
from django_dlock.celery import locked_task
from django_dlock.signals import task_deferred


def record(log: str, **event: Any) -> None:
    with open(log, "a") as out:
        out.write(json.dumps({**event, "pid": os.getpid(), "at": time.time()}) + "\n")


def read_log(log: str) -> list[dict[str, Any]]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line) for line in f]


def wait_for_file(path: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


def _body(task: Any, key: str, log: str, go: str | None) -> int:
    token = task.lock.token
    record(log, key=key, token=token, task_id=task.request.id, retries=task.request.retries)
    if go:
        wait_for_file(go)
    return int(token)


@locked_task(key="dedup:{key}", backend="celery", ttl=30, bind=True)
def dedup(self: Any, key: str, log: str, go: str | None = None) -> int:
    return _body(self, key, log, go)


@locked_task(key="dedup-q:{key}", backend="celery", ttl=30, scope="queue", bind=True)
def dedup_queued(self: Any, key: str, log: str, go: str | None = None) -> int:
    return _body(self, key, log, go)


@locked_task(key="default-key", backend="celery", bind=True)
def fixed_key(self: Any, log: str) -> int:
    return _body(self, "default-key", log, None)


@locked_task(backend="celery")
def hashed(account_id: int, full: bool = False) -> str:
    return "ran"


@locked_task(key="outcome:{key}", backend="celery", bind=True)
def outcome(self: Any, key: str, how: str, log: str | None = None) -> int:
    if log:
        record(log, key=key, token=self.lock.token)
    if how == "fail":
        raise ValueError("the body failed")
    if how == "ignore":
        raise Ignore()
    if how == "reject":
        raise Reject("rejected", requeue=False)
    return int(self.lock.token)


@locked_task(key="raise:{key}", backend="celery", on_locked="raise", bind=True)
def raising(self: Any, key: str, log: str, go: str | None = None) -> int:
    return _body(self, key, log, go)


@locked_task(key="wait:{key}", backend="celery", on_locked="wait", timeout=30, bind=True)
def waiting(self: Any, key: str, log: str, go: str | None = None) -> int:
    return _body(self, key, log, go)


@locked_task(
    key="retry-locked:{key}",
    backend="celery",
    on_locked="retry",
    countdown=0.2,
    bind=True,
    max_retries=10,
)
def retry_when_locked(self: Any, key: str, log: str, go: str | None = None) -> int:
    return _body(self, key, log, go)


def _retry_once(task: Any, key: str, log: str) -> int:
    record(log, key=key, token=task.lock.token, retries=task.request.retries)
    if task.request.retries == 0:
        raise task.retry(countdown=0)
    return int(task.request.retries)


@locked_task(key="retry:{key}", backend="celery", bind=True, max_retries=3)
def retry_once(self: Any, key: str, log: str) -> int:
    return _retry_once(self, key, log)


@locked_task(key="retry-q:{key}", backend="celery", scope="queue", bind=True, max_retries=3)
def retry_once_queued(self: Any, key: str, log: str) -> int:
    return _retry_once(self, key, log)


def _fail_once(task: Any, key: str, log: str) -> int:
    record(log, key=key, token=task.lock.token, retries=task.request.retries)
    if task.request.retries == 0:
        raise ValueError("the first attempt fails")
    return int(task.request.retries)


_AUTORETRY: dict[str, Any] = {
    "autoretry_for": (ValueError,),
    "retry_kwargs": {"countdown": 0, "max_retries": 3},
    "bind": True,
}


@locked_task(key="auto:{key}", backend="celery", **_AUTORETRY)
def auto_retry(self: Any, key: str, log: str) -> int:
    return _fail_once(self, key, log)


@locked_task(key="auto-q:{key}", backend="celery", scope="queue", **_AUTORETRY)
def auto_retry_queued(self: Any, key: str, log: str) -> int:
    return _fail_once(self, key, log)


@locked_task(key="slow:{key}", backend="celery", ttl=2, bind=True)
def slow(self: Any, key: str, log: str, seconds: float) -> None:
    record(log, key=key, token=self.lock.token, task_id=self.request.id)
    time.sleep(seconds)


@locked_task(key="later:{key}", backend="celery", scope="queue", ttl=60)
def later(key: str) -> str:
    return key


@locked_task(key="holder:{key}", backend="celery", bind=True)
def holder(self: Any, key: str, log: str, go: str) -> int:
    return _body(self, key, log, go)


def _count(counter: str, step: int) -> int:
    """Add ``step`` to the number in ``counter`` under an exclusive flock; return the new value."""
    import fcntl

    fd = os.open(counter, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        value = int(os.pread(fd, 16, 0) or b"0") + step
        os.pwrite(fd, str(value).encode().ljust(16), 0)
        return value
    finally:
        os.close(fd)


@locked_task(key="limited:{key}", backend="celery", limit=2, on_locked="defer", ttl=30, bind=True)
def limited(self: Any, key: str, log: str, counter: str, hold: float = 0.2) -> int:
    """The section counts the bodies inside it (across processes), and records the count."""
    return _counted_body(self, key, log, counter, hold)


def _counted_body(task: Any, key: str, log: str, counter: str, hold: float) -> int:
    inside = _count(counter, 1)
    try:
        delivery = [task.request.retries, getattr(task.request, "replaced_task_nesting", 0)]
        record(
            log,
            key=key,
            token=task.lock.token,
            task_id=task.request.id,
            delivery=delivery,
            inside=inside,
        )
        time.sleep(hold)
    finally:
        _count(counter, -1)
    return inside


def _record_deferral(sender: Any, task_id: str, args: Any, kwargs: Any, **rest: Any) -> None:
    log = kwargs.get("log") or (args[1] if len(args) > 1 else None)
    if isinstance(log, str):
        record(log, deferred=task_id)


task_deferred.connect(_record_deferral, weak=False)


@locked_task(key="limited1:{key}", backend="celery", limit=1, on_locked="defer", ttl=3, bind=True)
def limited_one(self: Any, key: str, log: str, counter: str, hold: float = 0.2) -> int:
    """As ``limited``, one at a time, with a short lease: for a worker killed mid-run."""
    return _counted_body(self, key, log, counter, hold)


@locked_task(key="broken:{key}", backend="celery", bind=True)
def broken_midway(self: Any, key: str) -> str:
    """Its lock is broken while the body runs, as an operator would (``locks break``)."""
    assert locks["celery"].break_lock(self.lock.name)
    return "done"


@locked_task(key="limited-skip:{key}", backend="celery", limit=2, ttl=30, bind=True)
def limited_skip(self: Any, key: str, log: str, go: str | None = None) -> int:
    """At most two bodies per key; a third call is skipped (the default ``on_locked``)."""
    return _body(self, key, log, go)
