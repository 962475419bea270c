"""Redis connections and threads: an ended thread's connection goes back to the pool.

Under ASGI each sync request runs on a thread of its own (and gunicorn's or
Celery's thread pools replace theirs); the backend must not keep a connection
per thread that ever ran a command.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.test import override_settings

from django_dlock import lock, locks, semaphore
from tests.servers import RedisServer, free_port

REDIS = "django_dlock.backends.redis.RedisBackend"
#: The pool's limit here: small, so that a few dozen threads outnumber it.
MAX_CONNECTIONS = 4


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A server of this test's own, so that its client count is this test's."""
    server = RedisServer(free_port()).start()
    yield server
    server.cleanup()


def clients(server: RedisServer) -> int:
    """Connected clients, less the one asking."""
    with redis.Redis(port=server.port) as client:
        return len(client.client_list()) - 1


def test_short_lived_threads_reuse_the_pools_connections(server: RedisServer, name: str) -> None:
    settings: dict[str, Any] = {
        "BACKEND": REDIS,
        "LOCATION": server.url,
        "OPTIONS": {"client_kwargs": {"max_connections": MAX_CONNECTIONS}},
    }
    errors: list[str] = []
    done: list[int] = []

    def request(i: int, barrier: threading.Barrier) -> None:
        try:
            barrier.wait(timeout=10)  # all of a round's threads are alive at once
            with lock(f"{name}:{i}", timeout=0), semaphore(f"{name}:s", limit=8, timeout=0):
                done.append(i)
        except Exception as e:  # reported below, with the thread
            errors.append(f"thread {i}: {e!r}")

    rounds = 6  # 24 threads, each a request, 6 times the pool's connections
    with override_settings(DLOCK_BACKENDS={"default": settings}):
        try:
            for r in range(rounds):
                barrier = threading.Barrier(MAX_CONNECTIONS)
                threads = [
                    threading.Thread(target=request, args=(r * MAX_CONNECTIONS + i, barrier))
                    for i in range(MAX_CONNECTIONS)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=30)
                assert clients(server) <= MAX_CONNECTIONS
            assert errors == []
            assert len(done) == rounds * MAX_CONNECTIONS
            pool = locks["default"].nodes[0].client.connection_pool  # type: ignore[attr-defined]
            assert len(pool._in_use_connections) == 0  # each ended thread gave its back
        finally:
            locks["default"].close()
    assert clients(server) == 0


def test_each_event_loop_s_client_goes_with_the_loop(server: RedisServer, name: str) -> None:
    """``asyncio.run()`` per call (``async_to_sync()`` from a thread without a loop does
    the same): a closed loop's client and its connection must not stay for good."""
    settings = {"BACKEND": REDIS, "LOCATION": server.url}

    async def request(i: int) -> None:
        async with lock(f"{name}:{i}", timeout=0):
            pass

    loops = 3 * MAX_CONNECTIONS
    with override_settings(DLOCK_BACKENDS={"default": settings}):
        try:
            for i in range(loops):
                asyncio.run(request(i))
            with warnings.catch_warnings():
                # The collector closes the dropped clients' sockets; their
                # loops are closed, so nobody could await a cleaner close.
                warnings.simplefilter("ignore", ResourceWarning)
                gc.collect()
            # The last loop's client is forgotten only when another loop comes.
            assert clients(server) <= 1
            assert len(locks["default"]._anode._clients) <= 1  # type: ignore[attr-defined]
        finally:
            locks["default"].close()
