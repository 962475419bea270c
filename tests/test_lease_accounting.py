"""Lease accounting under a slow or reordering link, on a real Redis (issue 28, items 1 and 2).

A TCP proxy (tests/netproxy.py) sits between the backend and its Redis: it
holds one request back (so a renewal lands after a later ``extend()``), or
adds latency both ways. What the handle believes is compared with what the
server holds (its ``PTTL``, read directly); tests/test_lease_simulation.py
covers the same on a virtual clock with every ordering.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from django_dlock.backends.redis import RedisBackend
from django_dlock.signals import lock_lost
from tests.netproxy import Proxy
from tests.servers import RedisServer, free_port


@pytest.fixture
def slow_redis() -> Iterator[tuple[RedisBackend, redis.Redis, Proxy]]:
    """(a backend behind a proxy, a plain client connected directly, the proxy)."""
    server = RedisServer(free_port()).start()
    proxy = Proxy(server.port)
    slow = RedisBackend("slow", {"LOCATION": proxy.url, "OPTIONS": {"socket_timeout": 10}})
    client = redis.Redis.from_url(server.url)
    slow.acquire("warm-up", timeout=0).release()  # load the scripts first
    try:
        yield slow, client, proxy
    finally:
        slow.close()
        client.close()
        proxy.close()
        server.cleanup()


def server_remaining(client: redis.Redis, name: str) -> float:
    """Seconds the server still holds ``name`` (0 once it let go)."""
    return max(0.0, client.pttl(f"{{dlock:0}}:lock:{name}") / 1000)


def test_a_renewal_that_lands_after_a_hand_extend_does_not_fool_the_handle(
    slow_redis: tuple[RedisBackend, redis.Redis, Proxy],
) -> None:
    """Issue 28 item 1: the renewal sent with ttl 3 lands after ``extend(30)`` returned."""
    slow, client, proxy = slow_redis
    name = f"overtaken-{uuid.uuid4().hex}"
    held = slow.acquire(name, ttl=3)
    try:
        time.sleep(0.5)
        proxy.delay_next_request(1.5)  # the renewal, sent at ~1.0 s, lands at ~2.5 s
        time.sleep(0.8)
        assert held.renewing  # its renewal is in the proxy
        held.extend(30)  # another connection: lands at once
        deadline = time.monotonic() + 6
        seen = []
        while time.monotonic() < deadline:
            believed = (
                held.expires_in
            )  # read before the server: the server's end can only move out
            actual = server_remaining(client, name)
            seen.append((round(believed, 2), round(actual, 2)))
            assert held.lost or believed <= actual + 0.05, (
                f"the handle believes it holds {believed:.2f} s more, the server "
                f"{actual:.2f} s (samples: {seen[-5:]})"
            )
            time.sleep(0.1)
        held.ensure()
    finally:
        held.release_quietly()


def test_renewals_over_a_slow_link_keep_the_lease(
    slow_redis: tuple[RedisBackend, redis.Redis, Proxy],
) -> None:
    """Issue 28 item 2: a 1.1 s round trip with ttl 3: renewals reach the server in time."""
    slow, client, proxy = slow_redis
    name = f"slow-link-{uuid.uuid4().hex}"
    lost: list[str] = []

    def record(sender: Any, name: str, reason: str, **kwargs: Any) -> None:
        lost.append(f"{name}: {reason}")

    lock_lost.connect(record, dispatch_uid="slow-link")
    try:
        held = slow.acquire(name, ttl=3)
        # The renewal thread's connection is made before the link slows (a new
        # connection's handshake would cost the proxy's latency several times).
        time.sleep(1.5)
        proxy.latency = 0.55  # each way
        time.sleep(8)
        assert not lost, lost
        assert not held.lost
        assert server_remaining(client, name) > 0
        proxy.latency = 0.0
        held.release()  # leaving the with block: no LockLost
    finally:
        lock_lost.disconnect(dispatch_uid="slow-link")
