"""A grant whose reply arrives after its lease ran out is not handed to the caller.

Found by the chaos run (``make chaos``, postgresql/blackhole): a worker's
acquire was granted, its reply held up ~4 s by the network, and ``acquire()``
returned a handle whose 2 s lease had run out; another worker held the lock
meanwhile. Its fenced write was refused, but the handle said "held".
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from django_dlock import BackendUnavailable, LockTimeout
from django_dlock.backends.redis import RedisBackend
from tests.netproxy import Proxy
from tests.servers import RedisServer, free_port


@pytest.fixture
def slow_redis() -> Iterator[tuple[RedisBackend, RedisBackend, Proxy]]:
    """(a backend behind a proxy, one connected directly, the proxy)."""
    server = RedisServer(free_port()).start()
    proxy = Proxy(server.port)
    slow = RedisBackend("slow", {"LOCATION": proxy.url, "OPTIONS": {"socket_timeout": 10}})
    direct = RedisBackend("direct", {"LOCATION": server.url})
    slow.acquire("warm-up", timeout=0).release()  # load the scripts first
    try:
        yield slow, direct, proxy
    finally:
        slow.close()
        direct.close()
        proxy.close()
        server.cleanup()


def test_a_grant_that_arrives_after_its_lease_ran_out_is_not_returned(
    slow_redis: tuple[RedisBackend, RedisBackend, Proxy],
) -> None:
    slow, direct, proxy = slow_redis
    name = f"late-{uuid.uuid4().hex}"
    proxy.latency = 0.4  # each way: the reply comes 0.8 s after the request, TTL 0.5 s
    # Not LockTimeout: nobody else held the lock, the service was too slow
    # (issue 28 item 11: a caller that skips work while the lock is held
    # skipped it for nothing).
    with pytest.raises(BackendUnavailable, match="too slow") as excinfo:
        slow.acquire(name, ttl=0.5, timeout=0, renew=False)
    assert excinfo.value.transient
    assert not isinstance(excinfo.value, LockTimeout)
    # The lease it was granted has run out; the lock is free for others.
    direct.acquire(name, timeout=0).release()


def test_a_waiter_whose_grant_came_late_tries_again(
    slow_redis: tuple[RedisBackend, RedisBackend, Proxy],
) -> None:
    slow, direct, proxy = slow_redis
    name = f"late-{uuid.uuid4().hex}"
    proxy.latency = 0.4
    timer = threading.Timer(1.0, lambda: setattr(proxy, "latency", 0.0))
    timer.start()
    try:
        held = slow.acquire(name, ttl=0.5, timeout=10, renew=False)
    finally:
        timer.join()
    # Whatever it returned is held now: nobody else can take it.
    assert held.expires_in > 0
    with pytest.raises(LockTimeout):
        direct.acquire(name, timeout=0)
    held.release()


def test_grants_that_keep_coming_late_end_in_backend_unavailable(
    slow_redis: tuple[RedisBackend, RedisBackend, Proxy],
) -> None:
    """Each try is granted, and each grant comes back after its lease ran out.

    The timeout runs out with the lock free all along: BackendUnavailable,
    which says how long the slowness was ridden out, not LockTimeout.
    """
    slow, direct, proxy = slow_redis
    name = f"late-{uuid.uuid4().hex}"
    proxy.latency = 0.4
    with pytest.raises(BackendUnavailable, match="too slow") as excinfo:
        slow.acquire(name, ttl=0.5, timeout=2.5, renew=False)
    assert "retried for" in str(excinfo.value)
    proxy.latency = 0.0
    direct.acquire(name, timeout=0).release()  # nobody holds it


def test_a_hand_over_that_runs_out_before_it_is_extended_is_waited_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis fair, renew=False: a waiter paused between accepting its 1 s hand-over
    lease and extending it to its TTL got LockNotOwned from acquire(); it waits again.

    The pause (a GC pause, SIGSTOP) is a sleep in the waiter's thread right
    after its grant was accepted, once.
    """
    from django_dlock.backends.attempts import Attempt

    server = RedisServer(free_port()).start()
    backend = RedisBackend("fair", {"LOCATION": server.url, "OPTIONS": {"fair": True}})
    accepted = Attempt._arrived_late
    paused: list[bool] = []

    def pause_once(self: Attempt, *args: object) -> bool:
        late = accepted(self, *args)  # type: ignore[arg-type]
        if not late and threading.current_thread().name == "waiter" and not paused:
            paused.append(True)
            time.sleep(1.3)  # past the 1 s hand-over lease
        return late

    monkeypatch.setattr(Attempt, "_arrived_late", pause_once)
    outcome: list[object] = []
    try:
        first = backend.acquire("n", ttl=30, timeout=0, renew=False)

        def wait() -> None:
            try:
                outcome.append(backend.acquire("n", ttl=10, timeout=20, renew=False))
            except Exception as e:
                outcome.append(e)

        waiter = threading.Thread(target=wait, name="waiter")
        waiter.start()
        time.sleep(0.5)
        first.release()  # hands the lock to the waiter, which then pauses
        waiter.join(30)
        assert paused, "the waiter was never handed the lock"
        [held] = outcome
        assert not isinstance(held, Exception), f"acquire() raised {held!r}"
        assert held.expires_in > 5  # type: ignore[union-attr]
        held.release()  # type: ignore[union-attr]
    finally:
        backend.close()
        server.cleanup()
