"""The conformance suite, continued: waiting, handing a lease over, odd names, fork, cancel.

As in ``test_conformance.py``, each test takes ``backend_alias`` and runs once
per backend under test.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
from functools import partial
from typing import Any

import pytest

from django_dlock import HeldLock, LockLost, LockNotOwned, LockTimeout, lock
from django_dlock.backends.base import Attempt, BaseLockBackend


def test_waiting_does_not_spin(
    backend_alias: str, backend: BaseLockBackend, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = 0
    original = backend.attempt_class.try_acquire

    def counting(self: Attempt) -> Any:
        nonlocal attempts
        if self.name == name:
            attempts += 1
        return original(self)

    with lock(name, backend=backend_alias):
        monkeypatch.setattr(backend.attempt_class, "try_acquire", counting)
        with pytest.raises(LockTimeout):
            lock(name, backend=backend_alias, timeout=1.0).acquire()
    # A busy loop makes thousands of attempts a second. Backing off (2 ms
    # doubling to 100 ms) makes under 20; being woken makes one or two.
    assert 1 <= attempts <= 40, attempts
    if backend.supports_wakeups:
        assert attempts <= 3, attempts


def test_waiters_are_served_in_arrival_order(
    backend_alias: str, backend: BaseLockBackend, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter arrives with its first attempt; a fair backend serves them in that order."""
    if not backend.supports_fair:
        pytest.skip(
            f"{backend_alias} does not declare supports_fair: "
            "waiters are not served in arrival order"
        )
    original = backend.attempt_class.try_acquire
    tried: set[int] = set()
    arrived = threading.Condition()

    def observed(self: Attempt) -> Any:
        result = original(self)
        with arrived:
            tried.add(threading.get_ident())
            arrived.notify_all()
        return result

    def has_tried(thread: threading.Thread) -> bool:
        return thread.ident in tried

    holder = lock(name, backend=backend_alias).acquire()
    monkeypatch.setattr(backend.attempt_class, "try_acquire", observed)
    order: list[tuple[int, int]] = []

    def waiter(i: int) -> None:
        with lock(name, backend=backend_alias, timeout=60) as held:
            order.append((i, held.token))

    threads = []
    for i in range(6):
        thread = threading.Thread(target=waiter, args=(i,))
        thread.start()
        threads.append(thread)
        # The next waiter starts only once this one has made its first attempt.
        with arrived:
            assert arrived.wait_for(partial(has_tried, thread), 30), f"waiter {i}"
    holder.release()
    for thread in threads:
        thread.join(60)
    assert [i for i, _ in order] == list(range(6))
    tokens = [holder.token] + [t for _, t in order]
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens
    # Nobody is left in line: the lock is free to the next caller at once.
    with lock(name, backend=backend_alias, timeout=0):
        pass


def test_waiter_is_not_stranded_when_the_holder_never_releases(
    backend_alias: str, name: str, short_ttl: float
) -> None:
    """A holder that dies sends no wake-up; its lease running out must free the waiter."""
    gone = lock(name, backend=backend_alias, ttl=short_ttl, renew=False).acquire()
    with lock(name, backend=backend_alias, timeout=15) as successor:
        assert successor.token > gone.token


def test_a_detached_lease_stays_held_until_its_adopter_releases_it(
    backend: BaseLockBackend, name: str
) -> None:
    held = backend.acquire(name, ttl=30, timeout=0, metadata={"note": "handed over"})
    ticket = json.loads(json.dumps(held.detach()))  # it travels as JSON
    assert held.detached
    held.release()  # a no-op: the lease is no longer this handle's
    with pytest.raises(LockLost):
        held.ensure()
    with pytest.raises(LockTimeout):
        backend.acquire(name, timeout=0)
    adopted = backend.adopt(ticket)
    assert (adopted.name, adopted.token) == (name, held.token)
    assert adopted.holder["note"] == "handed over"
    adopted.ensure()
    adopted.extend()
    [info] = [info for info in backend.list(name) if info.name == name]
    assert info.token == held.token
    adopted.release()
    assert backend.list(name) == []
    with backend.acquire(name, timeout=0) as again:
        assert again.token > held.token


def test_a_ticket_nobody_adopts_runs_out(
    backend: BaseLockBackend, name: str, short_ttl: float, past_expiry: float
) -> None:
    ticket = backend.acquire(name, ttl=short_ttl).detach()
    time.sleep(past_expiry)
    with backend.acquire(name, timeout=0) as newer:
        with pytest.raises(LockNotOwned):
            backend.adopt(ticket)
        newer.ensure()


def test_adopt_refuses_foreign_and_malformed_tickets(backend: BaseLockBackend, name: str) -> None:
    held = backend.acquire(name, ttl=30, timeout=0)
    ticket = held.detach()
    with pytest.raises(ValueError, match="for lock backend 'some-other-alias'"):
        backend.adopt({**ticket, "backend": "some-other-alias"})
    for bad in ({}, {**ticket, "v": 99}, {**ticket, "owner": ""}, {**ticket, "token": "x"}):
        with pytest.raises(ValueError):
            backend.adopt(bad)
    backend.adopt(ticket).release()


def test_release_ticket_releases_a_handed_over_lease_once(
    backend: BaseLockBackend, name: str, short_ttl: float, past_expiry: float
) -> None:
    held = backend.acquire(name, ttl=30, timeout=0)
    ticket = json.loads(json.dumps(held.detach()))
    assert backend.release_ticket(ticket) is True
    assert backend.list(name) == []
    assert backend.release_ticket(ticket) is False
    with backend.acquire(name, timeout=0) as newer:
        assert newer.token > held.token
        assert backend.release_ticket(ticket) is False  # never releases a newer holder
        newer.ensure()
    lapsed = backend.acquire(name, ttl=short_ttl).detach()
    time.sleep(past_expiry)
    assert backend.release_ticket(lapsed) is False
    with pytest.raises(ValueError):
        backend.release_ticket({**ticket, "v": 99})


# --- adversity (issue 15): each of these failed on the main it started from ------------


def test_a_ticket_is_adopted_at_most_once(backend: BaseLockBackend, name: str) -> None:
    """A redelivered message adopts its ticket again; the second adoption must be refused."""
    held = backend.acquire(name, ttl=30, renew=False)
    ticket = json.loads(json.dumps(held.detach()))
    first = backend.adopt(ticket)
    with pytest.raises(LockNotOwned, match="adopted already"):
        backend.adopt(ticket)
    assert backend.release_ticket(ticket) is False  # nor released through the old ticket
    first.ensure()
    [info] = backend.list(name)
    assert info.token == first.token == held.token
    with pytest.raises(LockTimeout):
        backend.acquire(name, timeout=0)
    first.release()
    with backend.acquire(name, timeout=0) as newer:
        assert newer.token > first.token


def test_concurrent_adopters_of_one_ticket_one_wins(backend: BaseLockBackend, name: str) -> None:
    ticket = backend.acquire(name, ttl=30, renew=False).detach()
    start = threading.Barrier(6)
    won: list[HeldLock] = []
    refused: list[BaseException] = []

    def adopt() -> None:
        start.wait(timeout=10)
        try:
            won.append(backend.adopt(ticket))
        except LockNotOwned as e:
            refused.append(e)

    threads = [threading.Thread(target=adopt) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) + len(refused) == 6
    if getattr(backend, "redlock", False):
        # Each master moves the lease on its own: two adopters that each win
        # one master are both refused (the lease then runs out). Never two.
        assert len(won) <= 1
    else:
        assert len(won) == 1
    for adopted in won:
        adopted.ensure()
        adopted.release()


# Of django-dlock's own backends, those whose waits are the default backoff
# (the others wait on a condition, a list or a watch, and never reach the code
# under test), and the backend under ``python -m django_dlock.testing``.
@pytest.mark.backends("example", "db-sqlite", "db-postgresql", "db-mysql", "under_test")
def test_a_long_wait_backs_off_without_overflowing(backend: BaseLockBackend, name: str) -> None:
    """About 77 s of 0.1 s waits is attempt 1024, where 2.0 ** attempt overflowed.

    A backend under test whose attempts wait their own way skips it.
    """
    from django_dlock._validation import holder_metadata, new_owner

    attempt = backend.ops().attempt(
        name, new_owner(), 1.0, holder_metadata(1.0, None), False, None
    )
    if type(attempt).wait is not Attempt.wait:
        pytest.skip(f"{type(attempt).__name__} waits its own way, not by Attempt.wait's backoff")
    for waits in (1023, 1024, 5000, 10**9):
        attempt.waits = waits
        attempt.wait(0.001)


@pytest.mark.parametrize(
    ("bad", "what"),
    [("a\x00b", "NUL"), ("\x00", "NUL"), ("x\ud800y", "surrogate"), ("\udfff", "surrogate")],
    ids=["nul-inside", "nul-alone", "high-surrogate", "low-surrogate"],
)
def test_bad_names_get_the_same_clear_error(
    backend_alias: str, backend: BaseLockBackend, name: str, bad: str, what: str
) -> None:
    odd = f"{name}:{bad}"
    with pytest.raises(ValueError, match=what):
        lock(odd, backend=backend_alias)
    with pytest.raises(ValueError, match=what):
        backend.acquire(odd, timeout=0)
    with pytest.raises(ValueError, match=what):
        backend.break_lock(odd)
    with pytest.raises(ValueError, match=what):
        backend.list(odd)

    @lock("{key}", backend=backend_alias, timeout=0)
    def templated(key: str) -> None:
        raise AssertionError("the body must not run")

    with pytest.raises(ValueError, match=what):
        templated(odd)
    assert backend.list(name) == []


@pytest.mark.multiprocess
def test_a_forked_child_leaves_the_parents_lease_alone(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    """A child forked inside ``with lock(...)`` leaves the block too; it must not release."""
    parent_lock = lock(name, backend=backend_alias, ttl=30)
    with parent_lock as held:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: leave the inherited block, as its code would
            outcome = b"?"
            try:
                parent_lock.__exit__(None, None, None)
                try:
                    held.ensure()
                    outcome = b"ensure passed"
                except LockLost as e:
                    outcome = b"ok" if "inherited through fork()" in str(e) else b"other LockLost"
            finally:
                os.write(write_end, outcome)
                os._exit(0)
        os.close(write_end)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read_end, "rb") as pipe:
            reported = pipe.read()
        if reported or not backend_alias.startswith("etcd"):
            assert reported == b"ok", (reported, status)
        # else: gRPC's fork handlers may abort an etcd client's child before it
        # runs any code of ours (SIGABRT); what matters is below, in the parent.
        held.ensure()  # still the parent's
        [info] = backend.list(name)
        assert info.token == held.token
        with pytest.raises(LockTimeout):
            backend.acquire(name, timeout=0)
    assert backend.list(name) == []


def test_a_cancelled_async_acquire_leaves_no_lease(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    """``wait_for(aacquire())`` cancelled after the attempt went out must not strand a lease.

    Whether the attempt was sent before the cancellation depends on timing, so
    it is tried on several names, each cancelled a little later than the one
    before (from 0.05 ms to about 4 ms: a backend that answers in well under
    0.5 ms, locmem, is cancelled too); afterwards each must be free at once
    (the lease asked for was 30 s).
    """
    names = [f"{name}:{i}" for i in range(16)]

    async def cancel_all() -> int:
        cancelled = 0
        for i, each in enumerate(names):
            try:
                held = await asyncio.wait_for(
                    lock(each, backend=backend_alias, ttl=30).aacquire(),
                    timeout=0.00005 * 1.35**i,
                )
            except asyncio.TimeoutError:
                cancelled += 1
            else:
                await held.arelease()
        return cancelled

    cancelled = asyncio.run(cancel_all())
    assert cancelled > 0, "no acquisition was cancelled; the test proves nothing"
    deadline = time.monotonic() + 10
    for each in names:
        # A worker thread's grant is released from the thread that got it.
        while True:
            try:
                backend.acquire(each, timeout=0, ttl=30).release()
                break
            except LockTimeout:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
