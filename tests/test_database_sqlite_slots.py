"""SQLite: a semaphore or rwlock slot inside ``atomic()`` behaves as the mutex does.

Review of issue 27: on SQLite (the zero-config default) a slot was taken on a
private connection, which cannot write once the caller's transaction has read
or written. A free semaphore, rwlock or ``lock_view(limit=N)`` was refused
with ``LockInTransaction`` (429 from a view) after any write, in a test or in
``setUpTestData`` of a ``TestCase`` too, where the mutex was granted. A slot
now joins the caller's transaction as the mutex does: granted at once when
free (bound to the connection until the transaction ends), refused at once
when full, and gone with a rollback.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import Client

from django_dlock import LockInTransaction, LockLost, LockNotOwned, locks, rwlock, semaphore
from django_dlock.backends.database import DatabaseBackend
from tests.models import Counter

BACKEND = "db-sqlite"
#: A bound that "at once" stays far below, seconds (the timeouts asked are 60).
AT_ONCE = 10.0


class Rollback(Exception):
    pass


def _slot(kind: str, name: str, timeout: float = 60) -> Any:
    if kind == "semaphore":
        return semaphore(name, limit=2, backend=BACKEND, timeout=timeout)
    side = rwlock(name, backend=BACKEND, timeout=timeout)
    return side.read() if kind == "read" else side.write()


def _blocker(kind: str, name: str) -> Any:
    """What leaves no slot for ``kind``: two holders of the semaphore, a writer, a reader."""
    if kind == "semaphore":
        return [semaphore(name, limit=2, backend=BACKEND, timeout=0).acquire() for _ in range(2)]
    side = rwlock(name, backend=BACKEND, timeout=0)
    return [(side.write() if kind == "read" else side.read()).acquire()]


def _backend() -> DatabaseBackend:
    backend = locks[BACKEND]
    assert isinstance(backend, DatabaseBackend)
    return backend


KINDS = ["semaphore", "read", "write"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", KINDS)
def test_sqlite_a_free_slot_inside_atomic_after_a_write_is_granted_at_once(
    kind: str, name: str
) -> None:
    """Before: LockInTransaction ("cannot be written: this transaction has read or written")."""
    backend = _backend()
    with transaction.atomic():
        Counter.objects.create(value=1)
        with _slot(kind, name) as held:
            assert held.owner in backend._bound  # renewed and released through this connection
            held.ensure()
            [info] = backend.semaphores(name)  # read in this transaction
            assert [h.token for h in info.holders] == [held.token]
            Counter.objects.create(value=2)
            held.extend()
    assert backend._bound == {}
    assert Counter.objects.count() == 2
    assert backend.semaphores(name) == []  # the release committed with the transaction
    with _slot(kind, name, timeout=0) as again:
        assert again.token > held.token


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", KINDS)
def test_sqlite_a_free_slot_inside_atomic_after_a_read_is_granted_at_once(
    kind: str, name: str
) -> None:
    """Before: LockInTransaction (the private connection's COMMIT waited for our read)."""
    with transaction.atomic():
        Counter.objects.count()
        with _slot(kind, name, timeout=0) as held:
            Counter.objects.create(value=1)
        assert held.released
    assert _backend().semaphores(name) == []
    assert _backend()._bound == {}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", KINDS)
def test_sqlite_a_full_slot_inside_atomic_after_a_write_is_refused_at_once(
    kind: str, name: str
) -> None:
    """Refused with LockInTransaction whatever the timeout, writing nothing; the work commits."""
    backend = _backend()
    holders = _blocker(kind, name)
    try:
        with transaction.atomic():
            Counter.objects.create(value=1)
            started = time.monotonic()
            with pytest.raises(LockInTransaction, match="before entering"):
                _slot(kind, name).acquire()
            assert time.monotonic() - started < AT_ONCE
            Counter.objects.create(value=2)
        assert Counter.objects.count() == 2  # the refusal did not spoil the transaction
        [info] = backend.semaphores(name)
        assert sorted(h.token for h in info.holders) == sorted(h.token for h in holders)
        assert info.waiting == 0  # no waiter row left behind
        for holder in holders:
            holder.ensure()  # the holders renew and release as usual
    finally:
        for holder in holders:
            holder.release()
    assert backend.semaphores(name) == []
    assert backend._bound == {}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", KINDS)
def test_sqlite_a_slot_rolled_back_with_the_callers_transaction_is_gone(
    kind: str, name: str
) -> None:
    """The rows vanish with the rollback: the handle finds its lease lost, no token repeats."""
    backend = _backend()
    with contextlib.suppress(Rollback), transaction.atomic():
        Counter.objects.create(value=1)
        held = _slot(kind, name, timeout=0).acquire()
        raise Rollback
    assert backend._bound == {}
    assert not connections["default"].allow_thread_sharing
    assert backend.semaphores(name) == []
    with pytest.raises(LockLost):
        held.ensure()
    with pytest.raises(LockNotOwned):
        held.release()
    with _slot(kind, name, timeout=0) as after:  # the slot is free again
        assert after.token > held.token  # a rolled-back token is not issued again


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_slot_rolled_back_with_a_savepoint_is_found_lost(name: str) -> None:
    """Still bound inside the outer transaction: its check there finds the row gone."""
    backend = _backend()
    with transaction.atomic():
        Counter.objects.create(value=1)
        with contextlib.suppress(Rollback), transaction.atomic():
            held = semaphore(name, limit=1, backend=BACKEND, timeout=0).acquire()
            raise Rollback
        with pytest.raises(LockLost):
            held.ensure()
        with semaphore(name, limit=1, backend=BACKEND, timeout=0) as again:
            assert again.token > held.token
    assert backend._bound == {}
    assert backend.semaphores(name) == []


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_slot_taken_before_a_rolled_back_transaction_stays_released(name: str) -> None:
    """Released inside atomic(), joined: the rollback undid it, so it is released again after."""
    held = semaphore(name, limit=1, backend=BACKEND, timeout=0).acquire()
    with contextlib.suppress(Rollback), transaction.atomic():
        Counter.objects.create(value=1)
        held.release()
        raise Rollback
    deadline = time.monotonic() + AT_ONCE
    while _backend().semaphores(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _backend().semaphores(name) == []
    with semaphore(name, limit=1, backend=BACKEND, timeout=0):
        pass


@pytest.mark.django_db  # Django's TestCase: the test runs inside a transaction
@pytest.mark.parametrize("kind", KINDS)
def test_sqlite_a_slot_after_a_write_in_a_test_case(kind: str, name: str) -> None:
    """Before: LockInTransaction in any TestCase that had created a row (the review's repro)."""
    Counter.objects.create(value=1)  # a fixture row, as setUpTestData makes
    for _ in range(2):
        with _slot(kind, name, timeout=5) as held:
            held.ensure()
    assert _backend().semaphores(name) == []


@pytest.mark.django_db  # Django's TestCase, a view under ATOMIC_REQUESTS
@pytest.mark.urls("tests.views_atomic")
def test_sqlite_a_limit_view_in_a_test_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``lock_view(limit=1)``: before, 429 to a request that found the semaphore free."""
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    counter = Counter.objects.create(value=0)
    url = f"/slot/{BACKEND}/default/{counter.pk}/"
    client = Client()
    assert [client.post(url).status_code for _ in range(2)] == [200, 200]
    assert Counter.objects.get(pk=counter.pk).value == 2
    holder = semaphore(f"counter:{counter.pk}", limit=1, backend=BACKEND, timeout=0).acquire()
    try:
        assert client.post(url).status_code == 429  # full: refused at once
    finally:
        holder.release()
    assert Counter.objects.get(pk=counter.pk).value == 2
