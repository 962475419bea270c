"""Batched renewals (issue 19): ``do_extend_many`` on every backend, and the renewal queue.

The watchdog renews each backend's due leases in batches, earliest-expiring
first; a lease that runs out before its turn is marked lost without a call,
and falling behind is reported once: a log line, ``watchdog_lagging``, and a
note that ``manage.py locks check`` prints.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.test import override_settings

from django_dlock import lock, locks
from django_dlock._validation import holder_metadata, new_owner
from django_dlock.backends.base import BaseLockBackend
from django_dlock.lag import LAG_PREFIX
from django_dlock.signals import watchdog_lagging
from django_dlock.watchdog import get_watchdog


def take(backend: BaseLockBackend, name: str, ttl: float) -> str:
    owner = new_owner()
    assert backend.do_acquire(name, owner, ttl, holder_metadata(ttl, None)[1]) is not None
    return owner


def test_extend_many_answers_for_each_lease(backend: BaseLockBackend, name: str) -> None:
    """Held leases are extended, each to its own TTL; the others are refused, in order."""
    mine = [take(backend, f"{name}:{i}", 2) for i in range(3)]
    theirs = take(backend, f"{name}:theirs", 30)
    released = take(backend, f"{name}:released", 30)
    assert backend.do_release(f"{name}:released", released)
    leases = [
        (f"{name}:0", mine[0], 20.0),
        (f"{name}:theirs", new_owner(), 20.0),  # held, by another owner
        (f"{name}:1", mine[1], 40.0),
        (f"{name}:released", released, 20.0),
        (f"{name}:never", new_owner(), 20.0),
        (f"{name}:2", mine[2], 20.0),
    ]
    assert backend.do_extend_many(leases) == [True, False, True, False, False, True]
    left = {info.name: info.expires_in for info in backend.list(name)}
    assert 10 < left[f"{name}:0"] <= 20 + backend.min_ttl
    assert 30 < left[f"{name}:1"] <= 40 + backend.min_ttl
    assert left[f"{name}:theirs"] <= 30 + backend.min_ttl
    assert f"{name}:released" not in left and f"{name}:never" not in left
    for i, owner in enumerate(mine):
        assert backend.do_release(f"{name}:{i}", owner)
    assert backend.do_release(f"{name}:theirs", theirs)


def test_extend_many_refuses_a_lease_that_ran_out(backend: BaseLockBackend, name: str) -> None:
    ttl = max(0.2, backend.min_ttl)
    owner = take(backend, name, ttl)
    time.sleep(ttl + backend.expiry_slack + 0.3)
    assert backend.do_extend_many([(name, owner, 10.0)]) == [False]
    assert backend.get(name) is None


@pytest.mark.backends("redis", "redis-cluster")
def test_redis_renews_a_batch_in_one_call_per_shard(
    backend: BaseLockBackend, name: str, redis_servers: Any
) -> None:
    """1,000 renewals: one EVALSHA for each shard the names fall in, not 1,000."""
    owners = {f"{name}:{i}": take(backend, f"{name}:{i}", 30) for i in range(1000)}
    calls: list[Any] = []
    node = backend.nodes[0]  # type: ignore[attr-defined]
    original = node.run

    def counting(script: Any, keys: list[Any], args: list[Any]) -> Any:
        calls.append(script)
        return original(script, keys, args)

    node.run = counting
    try:
        results = backend.do_extend_many([(n, o, 30.0) for n, o in owners.items()])
    finally:
        del node.run
    assert results == [True] * 1000
    shards = {backend.tag(n) for n in owners}  # type: ignore[attr-defined]
    assert len(calls) == len(shards) <= backend.shards  # type: ignore[attr-defined]
    for n, o in owners.items():
        backend.do_release(n, o)


@pytest.mark.backends("db-sqlite", "db-postgresql", "db-mysql")
def test_database_renews_a_batch_in_one_statement(backend: BaseLockBackend, name: str) -> None:
    """300 renewals of one TTL: one UPDATE (MySQL: and one SELECT), not 300."""
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    owners = {f"{name}:{i}": take(backend, f"{name}:{i}", 30) for i in range(300)}
    connection = connections[backend.database]  # type: ignore[attr-defined]
    with CaptureQueriesContext(connection) as queries:
        results = backend.do_extend_many([(n, o, 30.0) for n, o in owners.items()])
    assert results == [True] * 300
    statements = [q["sql"] for q in queries.captured_queries]
    assert len(statements) == (2 if connection.vendor == "mysql" else 1), statements
    for n, o in owners.items():
        backend.do_release(n, o)


@pytest.mark.backends("etcd")
def test_etcd_renews_a_batch_in_two_calls(backend: BaseLockBackend, name: str) -> None:
    """128 renewals: one keepalive of the session lease and one transaction reading the keys."""
    owners = {f"{name}:{i}": take(backend, f"{name}:{i}", 30) for i in range(128)}
    state = backend.state  # type: ignore[attr-defined]
    calls: list[str] = []
    call, keepalive = state.call, state.transport.keepalive

    def counting_call(n: str, stub: str, method: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(method)
        return call(n, stub, method, *args, **kwargs)

    def counting_keepalive(lease_id: int) -> int:
        calls.append("LeaseKeepAlive")
        return keepalive(lease_id)

    state.call, state.transport.keepalive = counting_call, counting_keepalive
    try:
        results = backend.do_extend_many([(n, o, 30.0) for n, o in owners.items()])
    finally:
        del state.call, state.transport.keepalive
    assert results == [True] * 128
    assert calls == ["LeaseKeepAlive", "Txn"]
    for n, o in owners.items():
        backend.do_release(n, o)


LOCMEM = {
    "default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"},
    "lagging": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"},
}


@pytest.fixture
def lagging_backend() -> Iterator[BaseLockBackend]:
    """A backend of its own, so that its renewal thread's lag state is this test's."""
    with override_settings(DLOCK_BACKENDS=LOCMEM):
        yield locks["lagging"]


def test_a_renewal_thread_that_falls_behind(lagging_backend: BaseLockBackend, name: str) -> None:
    """The renewal thread is stuck (a slow call) while renewals come due.

    t0    Z (ttl 1.2) and X (ttl 3) are taken; the renewal thread is stuck.
    t0.7  Y (ttl 1.2) is taken: due at 1.1 after X (due at 1.0), yet it ends
          first (at 1.9, X at 3.0).
    t1.2  Z runs out waiting: it is marked lost and never sent.
    t1.7  The thread is free again. Its first batch renews Y before X, and the
          lag is reported once: a log line, watchdog_lagging, a note.
    """
    backend = lagging_backend
    batches: list[list[str]] = []
    original = type(backend).do_extend_many

    def recording(self: BaseLockBackend, leases: Any) -> list[bool | Exception]:
        batches.append([n for n, _, _ in leases])
        return original(self, leases)

    reports: list[dict[str, Any]] = []

    def on_lagging(sender: Any, **kwargs: Any) -> None:
        reports.append(kwargs)

    free = threading.Event()
    watchdog_lagging.connect(on_lagging, dispatch_uid="test-lagging")
    type(backend).do_extend_many = recording  # type: ignore[method-assign]
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("django_dlock").addHandler(handler)
    try:
        get_watchdog().renewer("lagging").submit(lambda: free.wait(10))
        z = lock(f"{name}:z", backend="lagging", ttl=1.2).acquire()
        x = lock(f"{name}:x", backend="lagging", ttl=3).acquire()
        time.sleep(0.7)
        y = lock(f"{name}:y", backend="lagging", ttl=1.2).acquire()
        time.sleep(1.0)
        assert z.lost
        free.set()
        deadline = time.monotonic() + 5
        while not reports or not batches:
            assert time.monotonic() < deadline, "no renewal or no lag report"
            time.sleep(0.02)
        assert batches[0] == [f"{name}:y", f"{name}:x"]
        x.ensure()
        y.ensure()
        assert backend.get(f"{name}:z") is None
        # Falling behind again within the episode is not reported again.
        free.clear()
        get_watchdog().renewer("lagging").submit(lambda: free.wait(10))
        time.sleep(1.0)
        free.set()
        time.sleep(0.5)
        x.ensure()
        assert len(reports) == 1
        assert "lagging" in get_watchdog().lagging()
        report = reports[0]
        assert report["backend"] == "lagging" and report["late"] > 0.5
        assert log.getvalue().count("falling behind") == 1
        deadline = time.monotonic() + 5
        while not backend.list(LAG_PREFIX):
            assert time.monotonic() < deadline, "no note for locks check"
            time.sleep(0.02)
        out = io.StringIO()
        call_command("locks", "check", "--backend", "lagging", stdout=out)
        assert "fell behind renewing leases" in out.getvalue()
        assert "1 warning(s)" in out.getvalue()
        x.release()
        y.release()
    finally:
        free.set()
        del type(backend).do_extend_many
        watchdog_lagging.disconnect(dispatch_uid="test-lagging")
        logging.getLogger("django_dlock").removeHandler(handler)
        for info in backend.list(LAG_PREFIX):
            backend.do_break(info.name, None)
