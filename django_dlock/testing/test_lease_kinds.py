"""One way into a lease: ``acquire(name, limit=, weight=, template=)``, and the handle's kind.

On every backend that has semaphores (locmem, the databases, Redis, etcd):
a semaphore's or read/write lock's handle holds the real backend, its
signals name the backend's class, and its own ``get()`` and
``break_lock()`` act on the semaphore, never on a mutex of the same name.
A backend without semaphores refuses ``limit`` before any I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from django_dlock import (
    HeldLock,
    LockLost,
    LockTimeout,
    lock,
    locks,
    rwlock,
    semaphore,
)
from django_dlock.backends.base import BaseLockBackend
from django_dlock.backends.limits import RW_LIMIT
from django_dlock.backends.ops import MutexOps, SlotOps
from django_dlock.exceptions import LockConfigurationError
from django_dlock.signals import lock_acquired, lock_broken, lock_released, lock_timeout


@pytest.fixture
def slots(backend: BaseLockBackend) -> BaseLockBackend:
    if not backend.supports_semaphores:
        pytest.skip(f"backend {backend.alias!r} declares no supports_semaphores")
    return backend


@pytest.fixture
def received() -> Iterator[list[tuple[str, Any, dict[str, Any]]]]:
    seen: list[tuple[str, Any, dict[str, Any]]] = []

    def receiver(which: str) -> Any:
        def receive(sender: Any, **kwargs: Any) -> None:
            seen.append((which, sender, kwargs))

        return receive

    receivers = {
        signal: receiver(which)
        for which, signal in (
            ("acquired", lock_acquired),
            ("released", lock_released),
            ("timeout", lock_timeout),
            ("broken", lock_broken),
        )
    }
    for signal, receive in receivers.items():
        signal.connect(receive, weak=False)
    yield seen
    for signal, receive in receivers.items():
        signal.disconnect(receive)


def test_a_semaphore_handle_holds_the_backend_itself(
    backend_alias: str, slots: BaseLockBackend, name: str
) -> None:
    with semaphore(name, limit=2, backend=backend_alias, timeout=5) as held:
        assert held.backend is locks[backend_alias]
        assert type(held.backend) is type(slots)
        assert isinstance(held.ops, SlotOps)
        assert (held.kind, held.limit, held.ops.weight) == ("semaphore", 2, 1)
    with rwlock(name + ":rw", backend=backend_alias, timeout=5).write() as held:
        assert held.backend is locks[backend_alias]
        assert (held.kind, held.limit, held.ops.weight) == ("rwlock", RW_LIMIT, RW_LIMIT)
    with lock(name, backend=backend_alias, timeout=5) as held:
        assert held.backend is locks[backend_alias]
        assert isinstance(held.ops, MutexOps)
        assert (held.kind, held.limit) == ("lock", None)


def test_semaphore_and_rwlock_signals_name_the_backend_class(
    backend_alias: str,
    slots: BaseLockBackend,
    name: str,
    received: list[tuple[str, Any, dict[str, Any]]],
) -> None:
    rw = rwlock(name + ":rw", backend=backend_alias, timeout=0)
    for taking, refused in (
        (semaphore(name, limit=1, backend=backend_alias, timeout=0), None),
        (rw.write(), rw.read()),
        (rw.read(), rw.write()),
    ):
        taking.acquire()
        with pytest.raises(LockTimeout):
            (refused or taking).acquire()
        taking.release()
    held = semaphore(name, limit=1, backend=backend_alias, timeout=0).acquire()
    assert slots.break_slot(name, held.token) == 1
    with pytest.raises(LockLost):
        held.release()
    kinds = {which for which, _, _ in received}
    assert {"acquired", "released", "timeout", "broken"} <= kinds
    for which, sender, kwargs in received:
        assert sender is type(slots), (which, sender)
        assert kwargs["backend"] == backend_alias


def test_a_semaphore_handle_gets_and_breaks_its_own_slot(
    backend_alias: str, slots: BaseLockBackend, name: str
) -> None:
    """Its ``get()``/``break_lock()`` are the semaphore's, with a mutex of the same name held."""
    mutex = lock(name, backend=backend_alias, timeout=5).acquire()
    first = semaphore(name, limit=2, backend=backend_alias, timeout=5).acquire()
    second = semaphore(name, limit=2, backend=backend_alias, timeout=5).acquire()
    try:
        info = first.get()
        assert info is not None and info.name == name and info.token == first.token
        assert info.token != mutex.token or slots.get(name) != info
        listed = slots.semaphore(name)
        assert listed is not None and {h.token for h in listed.holders} == {
            first.token,
            second.token,
        }
        assert [s.name for s in slots.semaphores(name)] == [name]
        assert first.break_lock() is True
        assert first.get() is None
        assert first.break_lock() is False
        with pytest.raises(LockLost):
            first.ensure()
        # The other slot and the mutex of the same name are untouched.
        second.ensure()
        mutex.ensure()
        mine = mutex.get()
        assert mine is not None and mine.token == mutex.token
    finally:
        second.release_quietly()
        mutex.release_quietly()


def test_a_slot_refuses_detach_and_stays_held(
    backend_alias: str, slots: BaseLockBackend, name: str
) -> None:
    """A slot cannot travel as a ticket: a clear error, and the slot is still ours, renewed."""
    for acquiring in (
        semaphore(name, limit=2, backend=backend_alias, timeout=5, ttl=2),
        rwlock(name + ":rw", backend=backend_alias, timeout=5, ttl=2).read(),
    ):
        held = acquiring.acquire()
        try:
            with pytest.raises(TypeError, match="cannot be detached"):
                held.detach()
            assert not held.detached and not held.lost
            held.ensure()
            assert held.get() is not None
        finally:
            held.release()
        assert held.released


def test_a_mutex_handle_gets_and_breaks_its_own_lease(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    held = lock(name, backend=backend_alias, timeout=5).acquire()
    info = held.get()
    assert info is not None and (info.name, info.token) == (name, held.token)
    assert held.break_lock() is True
    assert held.get() is None
    with pytest.raises(LockLost):
        held.ensure()


def test_an_async_semaphore_handle_acts_on_its_slot(
    backend_alias: str, slots: BaseLockBackend, name: str
) -> None:
    async def take() -> HeldLock:
        held = await slots.aacquire(name, limit=3, timeout=5)
        await held.aensure()
        await held.aextend()
        return held

    held = asyncio.run(take())
    assert held.backend is slots and held.kind == "semaphore"
    assert slots.get(name) is None  # no mutex was taken
    assert held.get() is not None
    asyncio.run(held.arelease())
    assert slots.semaphore(name) is None


class _NoIO(BaseLockBackend):
    """A backend whose every call to its service fails the test."""

    def do_acquire(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no I/O expected")


def test_limit_on_a_backend_without_semaphores_is_refused_before_any_io() -> None:
    backend = _NoIO("no-slots", {})
    assert backend.supports_semaphores is False
    with pytest.raises(LockConfigurationError, match="'no-slots'") as excinfo:
        backend.acquire("x", limit=2, timeout=0)
    assert excinfo.value.alias == "no-slots"
    with pytest.raises(LockConfigurationError, match="'no-slots'"):
        asyncio.run(backend.aacquire("x", limit=2, timeout=0))
    assert backend.semaphores() == [] and backend.semaphore("x") is None
    with pytest.raises(LockConfigurationError, match="'no-slots'"):
        backend.break_slot("x")


def test_limit_on_redlock_names_the_alias(backend_alias: str, backend: BaseLockBackend) -> None:
    if backend.supports_semaphores:
        pytest.skip("the backend has semaphores")
    with pytest.raises(LockConfigurationError, match=repr(backend_alias)):
        semaphore("x", limit=2, backend=backend_alias, timeout=0).acquire()


def test_a_bad_limit_or_weight_is_refused(slots: BaseLockBackend, name: str) -> None:
    bad_limit: Any = "2"
    with pytest.raises(ValueError, match="limit"):
        slots.acquire(name, limit=0, timeout=0)
    with pytest.raises(TypeError, match="limit"):
        slots.acquire(name, limit=bad_limit, timeout=0)
    with pytest.raises(ValueError, match="weight"):
        slots.acquire(name, limit=2, weight=3, timeout=0)


def test_the_template_is_an_argument(backend_alias: str, name: str) -> None:
    templates: list[str | None] = []

    @lock(name + ":{key}", backend=backend_alias, timeout=5)
    def run(key: str) -> None:
        from django_dlock.lock import leases_here

        # By name: a lease an earlier test left unreleased may still be listed here.
        templates.extend(held.template for held in leases_here() if held.name == name + ":a")

    run("a")
    assert templates == [name + ":{key}"]
    held = locks[backend_alias].acquire(name + ":b", timeout=5, template="t:{key}")
    assert held.template == "t:{key}"
    held.release()
    held = locks[backend_alias].acquire(name + ":c", timeout=5)
    assert held.template is None
    held.release()
