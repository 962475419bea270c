"""Many asyncio waiters in one process on a fair Redis lock (issue 19, item 5).

They share one subscription and one keeper per lock (backends/redis/waiters.py)
instead of a connection and a re-check a second each. What is asserted is
order and exclusion, never speed (that is benchmarks/async_waiters.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
from django.test import override_settings

from django_dlock import lock, locks
from django_dlock.backends.redis import WAITER_LEASE_MS, RedisBackend
from tests.servers import RedisServer, free_port

pytestmark = pytest.mark.usefixtures("redis_servers")

ALIAS = "redis-fair"
REDIS = "django_dlock.backends.redis.RedisBackend"


def _queue_key(name: str) -> str:
    backend = locks[ALIAS]
    assert isinstance(backend, RedisBackend)
    return backend._keys(name).queue


class Served:
    """What the waiters saw: who entered, in which order, with which token."""

    def __init__(self) -> None:
        self.order: list[str] = []  # owners, in the order they entered
        self.tokens: list[int] = []
        self.inside = 0
        self.overlaps = 0

    async def waiter(self, name: str, **kwargs: Any) -> None:
        async with lock(name, backend=ALIAS, **kwargs) as held:
            self.inside += 1
            self.overlaps += self.inside > 1
            self.order.append(held.owner)
            self.tokens.append(held.token)
            await asyncio.sleep(0)
            self.inside -= 1


async def _all_queued(client: Any, name: str, count: int, within: float) -> list[str]:
    """The queue once it holds ``count`` waiters (arrival order, as Redis ran their enqueues)."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        if await client.llen(_queue_key(name)) >= count:
            break
        await asyncio.sleep(0.05)
    return list(await client.lrange(_queue_key(name), 0, -1))


def _client() -> Any:
    backend = locks[ALIAS]
    assert isinstance(backend, RedisBackend)
    return redis.asyncio.Redis.from_url(backend.locations[0], decode_responses=True)


def test_a_thousand_async_waiters_are_served_once_in_arrival_order(name: str) -> None:
    """1,000 tasks of one process queue behind a holder and are served in queue order.

    Before the shared subscription each waiter blocked a connection of its
    own (BLPOP), and redis-py's asyncio pool refuses the 101st: this test
    failed with the holder's own release raising BackendUnavailable ("Too
    many connections"), most waiters retrying outside the queue.
    """
    count = 1000
    served = Served()

    async def run() -> list[str]:
        client = _client()
        async with lock(name, backend=ALIAS) as gate:
            served.tokens.append(gate.token)
            tasks = [asyncio.create_task(served.waiter(name)) for _ in range(count)]
            arrival = await _all_queued(client, name, count, within=60)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        await client.aclose()
        return arrival

    arrival = asyncio.run(run())
    assert len(arrival) == count, f"only {len(arrival)} of {count} waiters got into the queue"
    assert served.order == arrival
    assert len(set(served.order)) == count
    assert served.overlaps == 0
    assert all(a < b for a, b in zip(served.tokens, served.tokens[1:], strict=False))


def test_a_cancelled_async_waiter_leaves_the_queue_and_the_rest_keep_their_order(
    name: str,
) -> None:
    served = Served()

    async def run() -> tuple[list[str], list[str], str]:
        client = _client()
        async with lock(name, backend=ALIAS):
            tasks = [asyncio.create_task(served.waiter(name)) for _ in range(50)]
            arrival = await _all_queued(client, name, 50, within=30)
            tasks[10].cancel()
            with pytest.raises(asyncio.CancelledError):
                await tasks[10]
            after = await client.lrange(_queue_key(name), 0, -1)
        await asyncio.wait_for(asyncio.gather(*tasks[:10], *tasks[11:]), 60)
        await client.aclose()
        (cancelled,) = set(arrival) - set(after)
        return arrival, after, cancelled

    arrival, after, cancelled = asyncio.run(run())
    assert len(after) == 49
    assert cancelled not in served.order
    assert served.order == [owner for owner in arrival if owner != cancelled]


def test_async_waiters_keep_their_place_past_the_waiter_lease(name: str) -> None:
    """Queued longer than WAITER_LEASE_MS without re-checking each: the keeper keeps them."""
    served = Served()

    async def run() -> tuple[list[str], list[str]]:
        client = _client()
        async with lock(name, backend=ALIAS):
            tasks = [asyncio.create_task(served.waiter(name)) for _ in range(20)]
            arrival = await _all_queued(client, name, 20, within=30)
            await asyncio.sleep(WAITER_LEASE_MS / 1000 + 1.0)
            later = await client.lrange(_queue_key(name), 0, -1)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await client.aclose()
        return arrival, later

    arrival, later = asyncio.run(run())
    assert later == arrival
    assert served.order == arrival


def test_async_waiters_take_over_from_a_holder_that_never_releases(name: str) -> None:
    """A lease that runs out (its holder gone) passes to the queued async waiters."""
    served = Served()
    abandoned = lock(name, backend=ALIAS, ttl=0.5, renew=False).acquire()

    async def run() -> list[str]:
        client = _client()
        tasks = [asyncio.create_task(served.waiter(name)) for _ in range(10)]
        arrival = await _all_queued(client, name, 10, within=30)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await client.aclose()
        return arrival

    arrival = asyncio.run(run())
    assert served.order == arrival
    assert served.tokens[0] > abandoned.token


def test_queued_async_waiters_ride_out_a_restart(name: str) -> None:
    """The server restarts (losing the queue and the lease) under 20 queued async waiters.

    The subscription fails, every waiter is woken and retries in its own
    loop; once the server is back they queue again, the subscription is made
    again, and each is served once.
    """
    server = RedisServer(free_port()).start()
    setting = {"default": {"BACKEND": REDIS, "LOCATION": server.url, "OPTIONS": {"fair": True}}}
    order: list[str] = []
    inside = [0, 0]  # now, overlaps

    async def waiter() -> None:
        async with lock(name, timeout=30) as held:
            inside[0] += 1
            inside[1] += inside[0] > 1
            order.append(held.owner)
            await asyncio.sleep(0)
            inside[0] -= 1

    async def run() -> None:
        client = redis.asyncio.Redis.from_url(server.url)
        holder = await lock(name, renew=False).aacquire()
        tasks = [asyncio.create_task(waiter()) for _ in range(20)]
        started = time.monotonic()
        backend = locks["default"]
        assert isinstance(backend, RedisBackend)
        while await client.llen(backend._keys(name).queue) < 20:
            assert time.monotonic() - started < 30, "the waiters did not queue"
            await asyncio.sleep(0.05)
        await client.aclose()
        server.stop()
        await asyncio.sleep(1.0)
        server.start()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await holder.arelease_quietly()  # its lease went with the restart

    try:
        with override_settings(DLOCK_BACKENDS=setting):
            asyncio.run(run())
            locks["default"].close()
    finally:
        server.cleanup()
    assert len(order) == len(set(order)) == 20
    assert inside[1] == 0
