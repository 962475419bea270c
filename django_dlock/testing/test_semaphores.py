"""Semaphores and read/write locks: the conformance suite, run against every backend's real server.

A backend that declares no ``supports_semaphores`` (Redlock, the example
backend) is skipped with that reason.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from django_dlock import (
    LimitMismatch,
    LockLost,
    LockNotOwned,
    LockTimeout,
    rwlock,
    semaphore,
)
from django_dlock.backends.base import BaseLockBackend
from django_dlock.backends.limits import RW_LIMIT
from django_dlock.backends.parking_backend import ParkingBackend
from django_dlock.backends.semaphore_backend import SemaphoreBackend


@pytest.fixture(autouse=True)
def needs_semaphores(backend: BaseLockBackend) -> None:
    if not backend.supports_semaphores:
        pytest.skip(f"backend {backend.alias!r} declares no supports_semaphores")


@pytest.fixture
def parking(backend: BaseLockBackend, name: str) -> Iterator[ParkingBackend]:
    """The backend, if it keeps parked tasks (the Celery integration's part); else a skip."""
    if not isinstance(backend, ParkingBackend):
        pytest.skip(f"backend {backend.alias!r} is no ParkingBackend: it parks no tasks")
    yield backend
    backend.do_unpark(name, 1000)


def test_at_most_limit_holders(backend_alias: str, backend: BaseLockBackend, name: str) -> None:
    held = [semaphore(name, limit=3, backend=backend_alias, timeout=0).acquire() for _ in range(3)]
    with pytest.raises(LockTimeout) as excinfo:
        semaphore(name, limit=3, backend=backend_alias, timeout=0).acquire()
    assert excinfo.value.name == name and excinfo.value.backend == backend_alias
    tokens = [h.token for h in held]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    (info,) = backend.semaphores(name)
    assert (info.name, info.kind, info.limit) == (name, "semaphore", 3)
    assert [h.token for h in info.holders] == tokens
    assert info.modes == ("slot", "slot", "slot")
    assert info.waiting == 0  # the refused try=0 attempt left no waiter behind
    held[1].release()
    again = semaphore(name, limit=3, backend=backend_alias, timeout=0).acquire()
    assert again.token > tokens[-1]
    for h in (held[0], held[2], again):
        h.release()
    assert backend.semaphores(name) == []


def test_the_mutex_and_the_semaphore_of_one_name_are_apart(backend_alias: str, name: str) -> None:
    from django_dlock import lock

    with lock(name, backend=backend_alias, timeout=0):
        with semaphore(name, limit=1, backend=backend_alias, timeout=0):
            pass


def test_a_waiter_enters_when_a_slot_frees(backend_alias: str, name: str) -> None:
    first = semaphore(name, limit=1, backend=backend_alias).acquire()
    got: list[int] = []

    def wait() -> None:
        with semaphore(name, limit=1, backend=backend_alias, timeout=10) as held:
            got.append(held.token)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    assert got == []
    released = time.monotonic()
    first.release()
    t.join(10)
    assert got and got[0] > first.token
    assert time.monotonic() - released < 5


def test_another_limit_is_refused_while_held(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    with semaphore(name, limit=2, backend=backend_alias):
        with pytest.raises(LimitMismatch) as excinfo:
            semaphore(name, limit=5, backend=backend_alias, timeout=1).acquire()
        assert (excinfo.value.limit, excinfo.value.held_limit) == (5, 2)
        assert isinstance(excinfo.value, ValueError)
        with pytest.raises(LimitMismatch):
            rwlock(name, backend=backend_alias, timeout=0).read().acquire()
    with semaphore(name, limit=5, backend=backend_alias, timeout=0):
        pass


def test_bad_limits_are_refused(backend_alias: str, name: str) -> None:
    for bad in (0, -1, 10**7):
        with pytest.raises(ValueError):
            semaphore(name, limit=bad, backend=backend_alias)
    wrong_types: tuple[Any, ...] = (1.5, "3", None, True)
    for wrong in wrong_types:
        with pytest.raises(TypeError):
            semaphore(name, limit=wrong, backend=backend_alias)


def test_a_slot_expires_with_its_lease(
    backend_alias: str, name: str, short_ttl: float, past_expiry: float
) -> None:
    held = semaphore(name, limit=1, backend=backend_alias, ttl=short_ttl, renew=False).acquire()
    time.sleep(past_expiry)
    with semaphore(name, limit=1, backend=backend_alias, timeout=0) as again:
        assert again.token > held.token
    with pytest.raises(LockLost):
        held.ensure()


def test_release_is_owner_checked(backend_alias: str, name: str) -> None:
    held = semaphore(name, limit=2, backend=backend_alias).acquire()
    held.release()
    with pytest.raises(LockNotOwned):
        held.extend()
    with pytest.raises(LockLost):
        held.ensure()


def test_breaking_frees_the_slot_with_that_token(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    a = semaphore(name, limit=2, backend=backend_alias).acquire()
    b = semaphore(name, limit=2, backend=backend_alias).acquire()
    assert backend.break_slot(name, token=a.token + b.token + 10) == 0
    assert backend.break_slot(name, token=a.token) == 1
    with pytest.raises(LockLost):
        a.ensure()
    b.ensure()
    (info,) = backend.semaphores(name)
    assert [h.token for h in info.holders] == [b.token]
    assert backend.break_slot(name) == 1
    with pytest.raises(LockLost):
        b.ensure()
    assert backend.semaphores(name) == []


def test_readers_share_and_a_writer_is_alone(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    rw = rwlock(name, backend=backend_alias, timeout=0)
    with rw.read() as r1, rw.read() as r2:
        with pytest.raises(LockTimeout):
            rw.write().acquire()
        (info,) = backend.semaphores(name)
        assert (info.kind, info.limit, info.modes) == ("rwlock", RW_LIMIT, ("read", "read"))
    with rw.write() as w:
        assert w.token > max(r1.token, r2.token)
        (info,) = backend.semaphores(name)
        assert info.modes == ("write",)
        with pytest.raises(LockTimeout):
            rw.read().acquire()
        with pytest.raises(LockTimeout):
            rw.write().acquire()
    with rw.read() as r3:
        assert r3.token > w.token


def test_a_waiting_writer_holds_back_new_readers(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    rw = rwlock(name, backend=backend_alias)
    reader = rw.read().acquire()
    order: list[str] = []

    def write() -> None:
        with rw.write().acquire_handle(timeout=10):
            order.append("write")

    t = threading.Thread(target=write)
    t.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(i.waiting for i in backend.semaphores(name)):
        time.sleep(0.02)
    with pytest.raises(LockTimeout):
        rw.read().acquire(timeout=0.3)  # the writer waits: no new reader
    reader.release()
    t.join(10)
    assert order == ["write"]
    with rw.read().acquire_handle(timeout=0) as again:
        assert again.token > reader.token


def test_a_dead_writers_wait_ends_with_its_ttl(
    backend_alias: str, backend: BaseLockBackend, name: str, short_ttl: float, past_expiry: float
) -> None:
    assert isinstance(backend, SemaphoreBackend)
    reader = rwlock(name, backend=backend_alias).read().acquire()
    # A writer that asked once and died: its waiter record ends after its TTL.
    assert (
        backend.do_acquire_slot(name, "dead-writer", short_ttl, "{}", False, RW_LIMIT, RW_LIMIT)
        is None
    )
    with pytest.raises(LockTimeout):
        rwlock(name, backend=backend_alias, timeout=0).read().acquire()
    time.sleep(past_expiry)
    with rwlock(name, backend=backend_alias, timeout=0).read():
        pass
    reader.release()


def test_decorator_with_a_template_and_async(backend_alias: str, name: str) -> None:
    inside: list[int] = []

    @semaphore(name + ":{n}", limit=1, backend=backend_alias, timeout=0)
    def body(n: int) -> int:
        inside.append(n)
        with pytest.raises(LockTimeout):
            semaphore(f"{name}:{n}", limit=1, backend=backend_alias, timeout=0).acquire()
        return n * 2

    assert body(3) == 6 and inside == [3]

    async def main() -> int:
        async with semaphore(name, limit=2, backend=backend_alias, timeout=5) as held:
            async with semaphore(name, limit=2, backend=backend_alias, timeout=5) as other:
                assert other.token > held.token
                with pytest.raises(LockTimeout):
                    await semaphore(name, limit=2, backend=backend_alias, timeout=0).aacquire()
            return held.token

    assert asyncio.run(main()) > 0


def test_parked_tasks_leave_in_order(
    backend_alias: str, parking: ParkingBackend, name: str
) -> None:
    backend = parking
    backend.do_park(name, "c", 30, '{"n": "c"}')
    backend.do_park(name, "a", 10, '{"n": "a"}')
    backend.do_park(name, "b", 20, '{"n": "b"}')
    backend.do_park(name, "a", 10, '{"n": "a2"}')  # parked again: replaced, not doubled
    listed = sorted(backend.do_list_parked(name), key=lambda p: p.order)
    assert [(p.key, p.order) for p in listed] == [("a", 10), ("b", 20), ("c", 30)]
    (info,) = backend.semaphores(name)
    assert info.parked == 3
    assert backend.do_unpark_key(name, "b") is True
    assert backend.do_unpark_key(name, "b") is False
    first = backend.do_unpark(name, 1)
    assert [(p.key, p.payload) for p in first] == [("a", '{"n": "a2"}')]
    assert [p.key for p in backend.do_unpark(name, 5)] == ["c"]
    assert backend.do_unpark(name, 5) == []


def test_a_writer_that_gives_up_lets_readers_in_at_once(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    rw = rwlock(name, backend=backend_alias)
    reader = rw.read().acquire()
    with pytest.raises(LockTimeout):
        rw.write().acquire(timeout=0.3)
    (info,) = backend.semaphores(name)
    assert info.waiting == 0  # its waiter record went with it
    with rw.read().acquire_handle(timeout=0):
        pass
    reader.release()


def test_semaphores_take_no_release_on_commit(backend_alias: str, name: str) -> None:
    with pytest.raises(TypeError, match="release_on_commit"):
        semaphore(name, limit=2, backend=backend_alias, release_on_commit=True)  # type: ignore[call-arg]


def test_a_cancelled_async_writer_stops_waiting_and_lets_readers_in(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    """Cancelling ``async with rwlock(...).write()`` is giving up: its waiter record goes.

    Found by review: the acquisition ran on in a worker thread after its
    caller was cancelled, refreshing its record, so new readers stayed out
    until the readers inside left (and the thread stayed busy).
    """
    reader = rwlock(name, backend=backend_alias).read().acquire()

    async def write() -> None:
        async with rwlock(name, backend=backend_alias, timeout=None).write():
            pass

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(write(), 0.5)

    asyncio.run(main())
    cancelled = time.monotonic()
    # A wait under way ends within its bound (Redis 1 s, the database 0.1 s).
    with rwlock(name, backend=backend_alias, timeout=5).read().acquire_handle():
        waited = time.monotonic() - cancelled
    assert waited < 2.5, f"a new reader waited {waited:.2f}s after the writer was cancelled"
    (info,) = backend.semaphores(name)
    assert info.waiting == 0
    reader.release()
