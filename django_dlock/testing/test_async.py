"""The async API on every backend: ``async with``, aacquire, aextend, aensure, arelease."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from django_dlock import LockLost, LockTimeout, lock, rwlock, semaphore
from django_dlock.backends.base import BaseLockBackend


def test_async_with_and_the_awaited_calls(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    async def scenario() -> None:
        async with lock(name, backend=backend_alias) as held:
            listed = await asyncio.to_thread(backend.list, name)  # the ORM is sync-only
            assert [i.token for i in listed] == [held.token]
            await held.aensure()
            await held.aextend(60)
            with pytest.raises(LockTimeout):
                await lock(name, backend=backend_alias, timeout=0).aacquire()
        assert await asyncio.to_thread(backend.list, name) == []

        guard = lock(name, backend=backend_alias)
        again = await guard.aacquire(timeout=5)
        assert again.token > held.token
        await guard.arelease()
        with pytest.raises(LockLost):
            await again.aensure()

        third = await lock(name, backend=backend_alias).aacquire()
        await third.arelease()
        assert third.released

    asyncio.run(scenario())


def test_the_watchdog_renews_while_the_event_loop_awaits(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    ttl = max(0.6, backend.min_ttl)

    async def scenario() -> None:
        async with lock(name, backend=backend_alias, ttl=ttl) as held:
            await asyncio.sleep(ttl * 3 + backend.expiry_slack)
            await held.aensure()  # renewed by the watchdog thread meanwhile

    asyncio.run(scenario())


def test_async_waiters_are_woken_by_a_release(backend_alias: str, name: str) -> None:
    async def scenario() -> list[str]:
        order: list[str] = []
        first = await lock(name, backend=backend_alias).aacquire()

        async def waiter() -> None:
            async with lock(name, backend=backend_alias, timeout=30):
                order.append("waiter")

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.2)
        order.append("release")
        await first.arelease()
        await task
        return order

    assert asyncio.run(scenario()) == ["release", "waiter"]


class _NoWorkerThreads(ThreadPoolExecutor):
    """A default executor that fails the test if anything is offloaded to a thread."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the async API used a worker thread")


@pytest.mark.backends("redis", "redis-fair")
def test_redis_is_native_async_with_no_worker_thread(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    assert backend.native_async

    async def scenario() -> list[int]:
        asyncio.get_running_loop().set_default_executor(_NoWorkerThreads())
        order: list[int] = []

        async def worker(n: int) -> None:
            async with lock(name, backend=backend_alias, timeout=30) as held:
                await held.aensure()
                await held.aextend(30)
                order.append(n)
                await asyncio.sleep(0.02)

        first = await lock(name, backend=backend_alias).aacquire()
        tasks = []
        for n in range(5):
            tasks.append(asyncio.create_task(worker(n)))
            await asyncio.sleep(0.05)  # they queue in this order
        with pytest.raises(LockTimeout):
            await lock(name, backend=backend_alias, timeout=0.1).aacquire()
        await first.arelease()
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(scenario())
    assert sorted(order) == [0, 1, 2, 3, 4]
    if backend_alias == "redis-fair":
        assert order == [0, 1, 2, 3, 4]  # FIFO, woken by hand-overs, not polling
    assert backend.list(name) == []


@pytest.mark.backends("redis", "redis-fair")
def test_redis_semaphores_are_native_async_with_no_worker_thread(
    backend_alias: str, backend: BaseLockBackend, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A semaphore's and a read/write lock's slots talk from the event loop, as mutexes do.

    Neither the loop's default executor nor the backend's own threads
    (``offload.py``) run anything: tries, waits, extends, checks, releases
    and the give-up of a timed-out waiter all come from the loop.
    """
    assert backend.ops(limit=2).native_async

    def no_thread(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the async API used one of the backend's threads")

    monkeypatch.setattr(backend.offload, "submit", no_thread)

    async def scenario() -> list[int]:
        asyncio.get_running_loop().set_default_executor(_NoWorkerThreads())
        order: list[int] = []

        async def worker(n: int) -> None:
            async with semaphore(name, limit=2, backend=backend_alias, timeout=30) as held:
                await held.aensure()
                await held.aextend(30)
                order.append(n)
                await asyncio.sleep(0.02)

        first = await semaphore(name, limit=2, backend=backend_alias).aacquire()
        second = await semaphore(name, limit=2, backend=backend_alias).aacquire()
        tasks = [asyncio.create_task(worker(n)) for n in range(4)]
        await asyncio.sleep(0.05)
        with pytest.raises(LockTimeout):
            await semaphore(name, limit=2, backend=backend_alias, timeout=0.1).aacquire()
        await first.arelease()
        await second.arelease()
        await asyncio.gather(*tasks)
        async with rwlock(name + ":rw", backend=backend_alias, timeout=5).write() as held:
            await held.aensure()
        return order

    assert sorted(asyncio.run(scenario())) == [0, 1, 2, 3]
    monkeypatch.undo()
    assert backend.semaphores(name) == []


@pytest.mark.backends("redis-cluster", "db-sqlite", "locmem", "etcd")
def test_other_backends_semaphores_are_not_native_async(backend: BaseLockBackend) -> None:
    assert not backend.ops(limit=2).native_async


@pytest.mark.backends("redis-cluster", "redlock", "etcd", "db-sqlite", "locmem")
def test_other_backends_offload_to_a_worker_thread(backend: BaseLockBackend) -> None:
    assert not backend.native_async
