"""Parked calls (``on_locked="defer"``) are never stranded and keep what Celery needs (issue 28).

The lock backends are real servers; the Celery app is a stand-in that records
what it would send, since what is checked is which calls go out, and when.
"""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from django_dlock import lock, locks
from django_dlock.celery import _send_parked_on_start, parking
from django_dlock.celery.parking import look_for_parked, park_payload, send_parked, stop_looking


class Sent:
    """A Celery app that records ``send_task`` calls; its one task defers on ``alias``."""

    def __init__(self, alias: str) -> None:
        options = SimpleNamespace(on_locked="defer", backend=alias)
        self.tasks = {"tests.deferred": SimpleNamespace(lock_options=options)}
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def send_task(self, name: str, **options: Any) -> None:
        with self.lock:
            self.calls.append({"name": name, **options})


def _request(**fields: Any) -> SimpleNamespace:
    return SimpleNamespace(**fields)


@pytest.mark.backends("redis", "etcd", "db-postgresql")
@pytest.mark.with_default_db
def test_parked_calls_are_sent_once_a_dead_holders_lease_ends_however_long_it_lived(
    backend_alias: str,
) -> None:
    """Issue 28 item 8: after a worker was killed, its parked calls stayed parked on etcd.

    A starting worker looked three times, and on etcd (which rounds what is
    left of a lease down and frees expired leases late) all three came
    before the dead holder's lease ended. Here the holder outlives three
    looks on purpose, then dies without popping anybody (its lease is left
    to run out): the looks must go on until the slot is free.
    """
    key = f"parked-{uuid.uuid4().hex[:8]}"
    backend = locks[backend_alias]
    holder = lock(key, backend=backend_alias, ttl=1.0).acquire()  # renewed while "alive"
    payload = park_payload("tests.deferred", ["a"], {}, {"routing_key": "q"}, 1, None)
    backend.do_park(key, "task-1", 1, payload)
    app = Sent(backend_alias)
    try:
        look_for_parked(app)  # as the worker that parked it does
        time.sleep(4.5)  # three looks and more, while the holder lives
        assert app.calls == []
        holder.detach()  # the worker dies: no release, no pop; the lease runs out
        deadline = time.monotonic() + 10
        while not app.calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [c["task_id"] for c in app.calls] == ["task-1"]
        assert backend.do_list_parked(key) == []
        time.sleep(2)  # no call is sent twice, and the looks stop (no parked call left)
        assert len(app.calls) == 1
        looking = [t for t in threading.enumerate() if isinstance(t, threading.Timer)]
        assert looking == []
    finally:
        backend.do_unpark_key(key, "task-1")


@pytest.mark.backends("redis", "etcd")
def test_a_running_worker_sends_the_calls_a_killed_worker_parked(
    backend_alias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of issue 28: a live, idle worker left a killed worker's parked calls parked.

    Only the process that parked a call, or a worker that starts, looked;
    the parking worker was the one killed. A worker now looks while it runs.
    """
    monkeypatch.setattr(parking, "LOOK_IDLE", 1.0)
    key = f"parked-{uuid.uuid4().hex[:8]}"
    backend = locks[backend_alias]
    app = Sent(backend_alias)
    _send_parked_on_start(sender=SimpleNamespace(app=app))  # worker B: nothing parked yet
    try:
        time.sleep(1.5)
        # Worker A runs a call and parks another, then is killed (kill -9).
        lock(key, backend=backend_alias, ttl=2.0).acquire().detach()
        payload = park_payload("tests.deferred", ["a"], {}, {"routing_key": "q"}, 1, None)
        backend.do_park(key, "task-2", 1, payload)
        deadline = time.monotonic() + 10
        while not app.calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [c["task_id"] for c in app.calls] == ["task-2"]
    finally:
        stop_looking()
        backend.do_unpark_key(key, "task-2")


@pytest.mark.backends("redis")
def test_a_parked_call_is_sent_again_with_its_reply_to_and_canvas(backend_alias: str) -> None:
    """Issue 28 item 9: with ``result_backend="rpc://"`` a deferred call's result never came.

    The call was sent again without its ``reply_to``, so the rpc backend sent
    the result to the worker that re-sent it. Its group and its place in a
    chain are kept too.
    """
    key = f"parked-{uuid.uuid4().hex[:8]}"
    request = _request(
        reply_to="4c5f-reply-queue",
        group_id="g-1",
        group_index=0,
        root_id="root-1",
        parent_id="parent-1",
        id="task-1",
        retries=2,
        replaced_task_nesting=1,
    )
    payload = park_payload("tests.deferred", [1], {"b": 2}, {"routing_key": "q"}, 7, None, request)
    locks[backend_alias].do_park(key, "task-1", 7, payload)
    app = Sent(backend_alias)
    assert send_parked(app, backend_alias, key, 1) == 1
    [call] = app.calls
    assert call["task_id"] == "task-1"
    # Its retry count and replace() nesting too (a copy of it is told by them).
    assert (call["retries"], call["replaced_task_nesting"]) == (2, 1)
    assert (call["args"], call["kwargs"], call["routing_key"]) == ([1], {"b": 2}, "q")
    kept = {
        k: call.get(k) for k in ("reply_to", "group_id", "group_index", "root_id", "parent_id")
    }
    assert kept == {
        "reply_to": "4c5f-reply-queue",
        "group_id": "g-1",
        "group_index": 0,
        "root_id": "root-1",
        "parent_id": "parent-1",
    }


@pytest.mark.backends("redis", "etcd", "db-postgresql", "locmem")
def test_an_entry_that_can_never_be_sent_is_dropped_and_the_next_call_goes(
    backend_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review of issue 30: parked again at the head, it took the one free slot on every look.

    Such an entry comes from a hand-made ``do_park`` or another version; the
    public ``park()`` refuses it. It is dropped with an ERROR that names it,
    and the call behind it is sent in the same look.
    """
    key = f"parked-{uuid.uuid4().hex[:8]}"
    backend = locks[backend_alias]
    for i, bad in enumerate(["this is not json", "{}", '{"task": "x", "args": 1, "kwargs": {}}']):
        backend.do_park(key, f"bad-{i}", i, bad)
    good = park_payload("tests.deferred", [1], {}, {}, 10, None)
    backend.do_park(key, "good", 10, good)
    app = Sent(backend_alias)
    with caplog.at_level("ERROR", logger="django_dlock.celery"):
        assert send_parked(app, backend_alias, key, 1) == 1
    assert [c["task_id"] for c in app.calls] == ["good"]
    dropped = [r.getMessage() for r in caplog.records if "Dropped" in r.getMessage()]
    assert len(dropped) == 3 and all("cannot be sent" in m for m in dropped), dropped
    assert backend.do_unpark(key, 10) == []
