"""The async API on every backend: ``async with``, aacquire, aextend, aensure, arelease."""

from __future__ import annotations

import asyncio

import pytest

from django_dlock import LockLost, LockTimeout, lock
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
