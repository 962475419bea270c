"""Redis connections and threads: an ended thread's connection goes back to the pool.

Under ASGI each sync request runs on a thread of its own (and gunicorn's or
Celery's thread pools replace theirs); the backend must not keep a connection
per thread that ever ran a command.
"""

from __future__ import annotations

import threading
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
