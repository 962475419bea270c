"""Redis-specific behaviour: restarts, FIFO queues, Cluster slots, Redlock quorum, connections.

The conformance suite already runs against single-node Redis (fair and not),
the 3-master Cluster and Redlock with one master down; these tests cover what
only Redis has.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core import checks
from django.test import override_settings

from django_dlock import BackendUnavailable, LockLost, LockTimeout, lock, locks, rwlock, semaphore
from django_dlock.backends.base import Grant
from django_dlock.backends.redis import (
    HANDOVER_LEASE_MS,
    SIGNAL_TTL_MS,
    WAITER_LEASE_MS,
    RedisBackend,
    RedisLocks,
    RedlockBackend,
    scripts,
    slot_scripts,
)
from django_dlock.checks import check_backends
from django_dlock.exceptions import LockConfigurationError
from tests.netproxy import Proxy
from tests.servers import RedisServer, free_port, redis_cli, wait_for

ROOT = Path(__file__).resolve().parent.parent
REDIS = "django_dlock.backends.redis.RedisBackend"
REDLOCK = "django_dlock.backends.redis.RedlockBackend"

pytestmark = pytest.mark.usefixtures("redis_servers")


def raw(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, decode_responses=True)


def test_tokens_survive_a_restart_that_loses_data(
    redis_servers: dict[str, Any], name: str
) -> None:
    server = redis_servers["single"]
    with lock(name, backend="redis") as before:
        pass
    server.restart()  # --save "" --appendonly no: everything is gone
    assert raw(server).dbsize() == 0
    with lock(name, backend="redis") as after:
        assert after.token > before.token


def test_a_lease_lost_with_the_servers_data_goes_to_another_holder_and_is_reported_lost(
    redis_servers: dict[str, Any], name: str
) -> None:
    """docs/choose-a-backend.md: a restart without persistence loses the leases held.

    Another client can then take the lock, with a larger token, and the old
    holder's ensure() raises LockLost.
    """
    server = redis_servers["single"]
    held = lock(name, backend="redis", ttl=30).acquire()
    try:
        server.restart()  # --save "" --appendonly no: the lease is gone
        with lock(name, backend="redis", timeout=10) as other:
            assert other.token > held.token
            with pytest.raises(LockLost):
                held.ensure()
    finally:
        with contextlib.suppress(LockLost):
            held.release()


def test_tokens_survive_an_older_snapshot(redis_servers: dict[str, Any], name: str) -> None:
    """A counter restored from an older snapshot must not make tokens repeat."""
    backend = locks["redis"]
    assert isinstance(backend, RedisBackend)
    keys = backend._keys(name)
    with lock(name, backend="redis") as first:
        pass
    client = raw(redis_servers["single"])
    client.hset(keys.fence, name, 5)  # as if the last writes were lost
    with lock(name, backend="redis") as second:
        assert second.token > first.token


def test_keys_are_as_documented(redis_servers: dict[str, Any], name: str) -> None:
    client = raw(redis_servers["single"])
    with lock(name, backend="redis", metadata={"note": "docs"}) as held:
        value = client.get(f"{{dlock:0}}:lock:{name}")
        owner, token, acquired_us, holder = value.split(":", 3)
        assert owner == held.owner and int(token) == held.token and int(acquired_us) > 0
        assert '"note":"docs"' in holder
        assert 0 < client.pttl(f"{{dlock:0}}:lock:{name}") <= 30_000
        assert int(client.hget("{dlock:0}:fence", name)) == held.token
        assert client.zscore("{dlock:0}:idx", name) == 0
    assert client.exists(f"{{dlock:0}}:lock:{name}") == 0
    assert client.zscore("{dlock:0}:idx", name) is None
    assert int(client.hget("{dlock:0}:fence", name)) == held.token
    # The release request's marker: 2 x socket_timeout (5 s) by default.
    [marker] = client.keys(f"{{dlock:0}}:done:{held.owner}:*")
    assert 0 < client.pttl(marker) <= 10_000


def test_expired_entries_leave_the_index(redis_servers: dict[str, Any], name: str) -> None:
    client = raw(redis_servers["single"])
    lock(name, backend="redis", ttl=0.3, renew=False).acquire()
    time.sleep(0.6)
    assert locks["redis"].list(name) == []
    assert client.zscore("{dlock:0}:idx", name) is None


def _queue(name: str) -> list[str]:
    backend = locks["redis-fair"]
    assert isinstance(backend, RedisBackend)
    client = redis.Redis.from_url(backend.locations[0], decode_responses=True)
    return client.lrange(backend._keys(name).queue, 0, -1)


def _queued_waiter(name: str, position: int, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    """Start a thread acquiring ``name`` on redis-fair; return once it is ``position``-th in line.

    The list receives the thread's HeldLock when it gets the lock.
    """
    got: list[Any] = []
    thread = threading.Thread(
        target=lambda: got.append(lock(name, backend="redis-fair", **kwargs).acquire())
    )
    thread.start()
    wait_for(lambda: len(_queue(name)) == position, 30, f"waiter {position} queued")
    return thread, got


def test_fair_waiter_that_gives_up_leaves_the_queue(name: str) -> None:
    holder = lock(name, backend="redis-fair").acquire()
    gave_up = threading.Event()

    def impatient() -> None:
        try:
            lock(name, backend="redis-fair", timeout=0.3).acquire()
        except LockTimeout:
            gave_up.set()

    first = threading.Thread(target=impatient)
    first.start()
    wait_for(lambda: len(_queue(name)) == 1, 10, "the impatient waiter queued")
    second, got = _queued_waiter(name, 2, timeout=30)
    first.join(10)
    assert gave_up.is_set()
    assert len(_queue(name)) == 1
    holder.release()
    second.join(30)
    assert got and got[0].token > holder.token
    locks["redis-fair"].break_lock(name)


def test_timeout_zero_does_not_stay_queued(name: str) -> None:
    with lock(name, backend="redis-fair"):
        with pytest.raises(LockTimeout):
            lock(name, backend="redis-fair", timeout=0).acquire()
        assert _queue(name) == []


@pytest.mark.multiprocess
def test_fair_waiter_that_dies_leaves_the_queue(name: str) -> None:
    """A waiter killed with SIGKILL must not stall the queue past its waiter lease."""
    holder = lock(name, backend="redis-fair").acquire()
    backend = locks["redis-fair"]
    assert isinstance(backend, RedisBackend)
    code = (
        "import django, sys; from django.conf import settings; "
        "settings.configure(INSTALLED_APPS=['django_dlock'], DLOCK_BACKENDS={'default': "
        f"{{'BACKEND': {REDIS!r}, 'LOCATION': {backend.locations[0]!r}, "
        "'OPTIONS': {'fair': True}}}); django.setup(); from django_dlock import lock; "
        f"lock({name!r}, timeout=60).acquire()"
    )
    doomed = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    wait_for(lambda: len(_queue(name)) == 1, 30, "the doomed waiter queued")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait()
    survivor, got = _queued_waiter(name, 2, timeout=60)  # behind the dead waiter
    holder.release()
    survivor.join(WAITER_LEASE_MS / 1000 * 5)
    assert got, "the dead waiter stalled the queue"
    locks["redis-fair"].break_lock(name)


def test_cluster_keys_of_a_lock_share_one_slot(redis_servers: dict[str, Any]) -> None:
    backend = locks["redis-cluster"]
    assert isinstance(backend, RedisBackend)
    port = redis_servers["cluster"][0].port
    masters = set()
    for i in range(40):
        k = backend._keys(f"slot-test:{i}:{{odd}}")
        slots = {
            redis_cli(port, "cluster", "keyslot", key).strip()
            for key in (k.lock, k.fence, k.index, k.wake, k.waiting, k.queue, k.queue_deadlines)
        }
        assert len(slots) == 1, slots
        masters.add(backend._tags.index(k.lock.split(":lock:")[0]))
    assert len(masters) > 1, "locks should spread over the index shards"


def test_cluster_spreads_locks_over_masters(redis_servers: dict[str, Any], name: str) -> None:
    names = [f"{name}:{i}" for i in range(24)]
    held = [lock(n, backend="redis-cluster").acquire() for n in names]
    try:
        # Each master answers only for its own slots; count the lock keys it has.
        per_master = [
            len(redis.Redis(port=s.port).keys(f"*:lock:{name}:*"))
            for s in redis_servers["cluster"]
        ]
        assert sum(per_master) == len(names)
        assert sum(1 for count in per_master if count) >= 2, per_master
        assert sorted(i.name for i in locks["redis-cluster"].list(name)) == sorted(names)
    finally:
        for h in held:
            h.release()


def _redlock(redis_servers: dict[str, Any]) -> tuple[RedlockBackend, list[RedisServer]]:
    """The Redlock backend and its two running masters (the third is kept stopped)."""
    backend = locks["redlock"]
    assert isinstance(backend, RedlockBackend)
    live = [s for s in redis_servers["redlock"] if s.process is not None]
    assert len(live) == 2
    return backend, live


def test_redlock_token_is_the_maximum_over_the_majority(
    redis_servers: dict[str, Any], name: str
) -> None:
    backend, live = _redlock(redis_servers)
    # Give one master a counter far ahead, as if it had issued more tokens.
    k = backend._keys(name)
    raw(live[1]).hset(k.fence, name, 9_000_000_000_000_000)
    with lock(name, backend="redlock") as held:
        fences = [int(raw(s).hget(k.fence, name)) for s in live]
        assert held.token == max(fences) == 9_000_000_000_000_001


def test_redlock_failed_attempt_releases_everywhere(
    redis_servers: dict[str, Any], name: str
) -> None:
    backend, live = _redlock(redis_servers)
    k = backend._keys(name)
    raw(live[1]).set(k.lock, "someone-else", px=30_000)  # held on one of the two live masters
    with pytest.raises(LockTimeout):
        lock(name, backend="redlock", timeout=0).acquire()
    # The refusals of live[1] and of the stopped master decide the attempt, and
    # it may return before live[0] answers: live[0] gets the undo after its
    # grant, in order (Master.submit), and the caller does not wait for it.
    deadline = time.monotonic() + 5
    while raw(live[0]).exists(k.lock) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert raw(live[0]).exists(k.lock) == 0, "the partial acquisition was not undone"
    assert raw(live[1]).get(k.lock) == "someone-else"
    raw(live[1]).delete(k.lock)


def test_redlock_without_a_quorum_is_unavailable(redis_servers: dict[str, Any], name: str) -> None:
    second = redis_servers["redlock"][1]
    second.stop()
    try:
        with pytest.raises(BackendUnavailable):
            lock(name, backend="redlock", timeout=0).acquire()
        # Nor can one master say who holds a lock, or that nobody does.
        with pytest.raises(BackendUnavailable):
            locks["redlock"].get(name)
        with pytest.raises(BackendUnavailable):
            locks["redlock"].list(name)
    finally:
        second.start()
    with lock(name, backend="redlock", timeout=0) as held:
        assert held.token > 0


def test_redlock_undo_follows_a_slow_grant(name: str) -> None:
    """An attempt without a quorum is undone on a master whose grant was still out.

    Two masters refuse connections at once, so the attempt is decided before
    the third answers. The undo must reach that master after its grant, not
    overtake it on another connection: a grant that lands after its undo is a
    key nobody holds, refusing everyone until its TTL ends.
    """
    server = RedisServer(free_port()).start()
    proxy = Proxy(server.port)
    dead = [f"redis://127.0.0.1:{free_port()}/0" for _ in range(2)]
    backend = RedlockBackend(
        "redlock-slow", {"LOCATION": [proxy.url, *dead], "OPTIONS": {"socket_timeout": 2}}
    )
    try:
        # Load the scripts on the live master, so each attempt is one request.
        RedisBackend("redlock-slow-warm", {"LOCATION": server.url}).acquire(
            "warm", timeout=0
        ).release()
        for attempt in range(3):
            proxy.delay_next_request(0.3)
            with pytest.raises(BackendUnavailable):
                backend.acquire(name, ttl=30, timeout=0)
            k = backend._keys(name)
            wait_for(lambda: proxy._delay_next == 0, 5, "the held request")
            time.sleep(0.5)  # past the held grant's arrival
            assert raw(server).exists(k.lock) == 0, f"attempt {attempt}: a grant outlived its undo"
    finally:
        backend.close()
        proxy.close()
        server.cleanup()


def test_redlock_lease_counts_clock_drift() -> None:
    backend = locks["redlock"]
    assert backend.drift(10) == pytest.approx(0.102)
    assert locks["redis"].drift(10) == 0


def test_django_redis_connection_reuses_the_cache_pool(name: str) -> None:
    from django_redis import get_redis_connection

    backend = locks["redis-django"]
    assert isinstance(backend, RedisBackend)
    with lock(name, backend="redis-django") as held:
        assert backend.nodes[0].client is get_redis_connection("locks")
        assert [i.token for i in locks["redis"].list(name)] == [held.token]


def test_password_and_database_in_the_url(name: str) -> None:
    server = RedisServer(free_port(), "--requirepass", "s3cret").start()
    try:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        with (
            override_settings(DLOCK_BACKENDS={"default": {"BACKEND": REDIS, "LOCATION": url}}),
            lock(name) as held,
        ):
            client = redis.Redis(port=server.port, password="s3cret", db=3)
            assert client.exists(f"{{dlock:0}}:lock:{name}") == 1
            assert held.token > 0
        bad = f"redis://:wrong@127.0.0.1:{server.port}/3"
        with override_settings(DLOCK_BACKENDS={"default": {"BACKEND": REDIS, "LOCATION": bad}}):
            with pytest.raises(BackendUnavailable) as excinfo:
                lock(name, timeout=0).acquire()
        # Messages end up in logs and on operators' screens: no password.
        assert f"redis://:***@127.0.0.1:{server.port}/3" in str(excinfo.value)
        assert "wrong" not in str(excinfo.value)
    finally:
        server.cleanup()


def test_redlock_ping_fails_without_a_quorum(redis_servers: dict[str, Any]) -> None:
    second = redis_servers["redlock"][1]
    second.stop()
    try:
        with pytest.raises(BackendUnavailable, match="Fewer than 2 of 3 Redlock masters"):
            locks["redlock"].ping()
    finally:
        second.start()
    # Back to a quorum. A connection pooled before the restart may fail its
    # first command ("Connection closed by server"): the pings that follow
    # within a few seconds must succeed, with the one stopped master's warning.
    deadline = time.monotonic() + 5
    while True:
        try:
            status = locks["redlock"].ping()
            break
        except BackendUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert len(status.warnings) == 1


def test_tls_with_rediss_url(tls_files: dict[str, Path], name: str) -> None:
    port = free_port()
    server = RedisServer(
        free_port(),
        "--tls-port", str(port),
        "--tls-cert-file", str(tls_files["cert"]),
        "--tls-key-file", str(tls_files["key"]),
        "--tls-ca-cert-file", str(tls_files["ca"]),
        "--tls-auth-clients", "no",
    ).start()  # fmt: skip
    try:
        settings = {
            "BACKEND": REDIS,
            "LOCATION": f"rediss://127.0.0.1:{port}/0",
            "OPTIONS": {"client_kwargs": {"ssl_ca_certs": str(tls_files["ca"])}},
        }
        with override_settings(DLOCK_BACKENDS={"default": settings}), lock(name) as held:
            assert [i.token for i in locks["default"].list(name)] == [held.token]
    finally:
        server.cleanup()


@pytest.mark.parametrize(
    ("params", "mentions"),
    [
        ({"LOCATION": "http://127.0.0.1:6379"}, "redis://"),
        ({"LOCATION": 6379}, "LOCATION"),
        ({"LOCATION": "redis://x", "KEY_PREFIX": "a{b}"}, "braces"),
        (
            {"LOCATION": ["redis://a", "redis://b", "redis://c"], "OPTIONS": {"fair": True}},
            "Redlock",
        ),
        ({"LOCATION": "redis://x", "OPTIONS": {"connection": "django-redis:locks"}}, "not both"),
        ({"OPTIONS": {"connection": "locks"}}, "django-redis:"),
        ({"LOCATION": "redis://x", "OPTIONS": {"shards": 0}}, "shards"),
        ({"LOCATION": "redis://x", "OPTIONS": {"fair": "yes"}}, "fair"),
        ({"LOCATION": "redis://x", "OPTIONS": {"socket_timeout": -1}}, "socket_timeout"),
    ],
)
def test_bad_redis_settings_are_check_errors(params: dict[str, Any], mentions: str) -> None:
    setting = {"default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}}
    setting["r"] = {"BACKEND": REDIS, **params}
    with override_settings(DLOCK_BACKENDS=setting):
        errors = list(check_backends())
    assert [e.id for e in errors] == ["django_dlock.E006"], errors
    assert mentions in errors[0].msg and "'r'" in errors[0].msg


def test_even_redlock_is_a_warning() -> None:
    setting = {
        "default": {"BACKEND": REDLOCK, "LOCATION": ["redis://a", "redis://b"]},
    }
    with override_settings(DLOCK_BACKENDS=setting):
        assert [e.id for e in check_backends()] == ["django_dlock.W001"]


def test_a_list_location_on_redis_backend_is_an_error_naming_redlock_backend() -> None:
    """Django's RedisCache reads a list as a primary and replicas; Redlock is its own class."""
    urls = ["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6380/0", "redis://127.0.0.1:6381/0"]
    with pytest.raises(LockConfigurationError, match="RedlockBackend") as caught:
        RedisBackend("listed", {"LOCATION": urls})
    assert caught.value.check_id == "django_dlock.E006"
    setting = {"default": {"BACKEND": REDIS, "LOCATION": urls}}
    with override_settings(DLOCK_BACKENDS=setting):
        [error] = check_backends()
    assert isinstance(error, checks.Error) and error.id == "django_dlock.E006"
    assert "django_dlock.backends.redis.RedlockBackend" in error.msg


def test_redlock_backend_on_three_masters_passes_the_checks(
    redis_servers: dict[str, Any],
) -> None:
    urls = [s.url for s in redis_servers["redlock"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend = RedlockBackend("listed", {"LOCATION": urls})
    try:
        assert backend.check() == []
    finally:
        backend.close()


@pytest.mark.parametrize("location", ["redis://127.0.0.1:6379/0", ["redis://127.0.0.1:6379/0"]])
def test_redlock_backend_needs_a_list_of_masters(location: Any) -> None:
    with pytest.raises(LockConfigurationError, match="RedisBackend"):
        RedlockBackend("one", {"LOCATION": location})
    setting = {"default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}}
    setting["r"] = {"BACKEND": REDLOCK, "LOCATION": location}
    with override_settings(DLOCK_BACKENDS=setting):
        errors = list(check_backends())
    assert [e.id for e in errors] == ["django_dlock.E006"], errors
    assert "'r'" in errors[0].msg and "list" in errors[0].msg


@pytest.mark.parametrize("alias", ["redis", "redis-cluster", "redlock"])
def test_get_reads_the_lease_on_exactly_one_name(
    alias: str, name: str, redis_servers: dict[str, Any]
) -> None:
    backend = locks[alias]
    assert isinstance(backend, RedisLocks)
    assert backend.do_get(name) is None
    with lock(f"{name}:child", backend=alias):
        assert backend.do_get(name) is None  # a name, not a prefix
        with lock(name, backend=alias, metadata={"note": "get"}) as held:
            info = backend.do_get(name)
            assert info is not None
            assert (info.backend, info.name, info.token) == (alias, name, held.token)
            assert info.holder["note"] == "get"
            assert 0 < info.expires_in <= 30
            [listed] = [i for i in backend.do_list(name) if i.name == name]
            assert (info.token, info.holder, info.acquired_at) == (
                listed.token,
                listed.holder,
                listed.acquired_at,
            )
    assert backend.do_get(name) is None


def test_redlock_get_reads_what_a_majority_holds(redis_servers: dict[str, Any], name: str) -> None:
    """One master stopped: a lease on the other two is found, one on a single master is not."""
    backend, live = _redlock(redis_servers)
    with lock(name, backend="redlock") as held:
        info = backend.do_get(name)
        assert info is not None and info.token == held.token
    lock_key = backend._keys(name).lock
    raw(live[1]).set(lock_key, f"someone:{2**40}:{2**40}:{{}}", px=30_000)
    try:
        assert backend.do_get(name) is None  # a minority: one master of three
        raw(live[0]).set(lock_key, f"someone:{2**40}:{2**40}:{{}}", px=30_000)
        info = backend.do_get(name)
        assert info is not None and info.token == 2**40
    finally:
        for server in live:
            raw(server).delete(lock_key)


def _lua_functions(text: str) -> dict[str, str]:
    return {
        m.group(2): textwrap.dedent(m.group(0))
        for m in re.finditer(r"^( *)local function (\w+)\(.*?^\1end$", text, re.S | re.M)
    }


def test_the_scripts_copies_of_the_queue_functions_agree() -> None:
    """Each script is one literal (issue 17); the functions written into several must agree."""
    copies: dict[str, set[str]] = {}
    for script in scripts.ALL.values():
        for fn, body in _lua_functions(script.text).items():
            copies.setdefault(fn, set()).add(body)
    assert {"grant", "live_head", "hand_off", "enqueue"} <= set(copies)
    assert {fn: len(bodies) for fn, bodies in copies.items()} == dict.fromkeys(copies, 1)


def test_the_scripts_use_the_constants_they_name() -> None:
    values = {"HANDOVER_LEASE_MS": HANDOVER_LEASE_MS, "SIGNAL_TTL_MS": SIGNAL_TTL_MS}
    marked = 0
    for script in scripts.ALL.values():
        lines = script.text.splitlines()
        for i, line in enumerate(lines):
            code, _, comment = line.partition("--")
            for constant, value in values.items():
                if comment.strip().rstrip(":") == constant:
                    marked += 1
                    assert str(value) in (code if code.strip() else lines[i + 1]), line
    assert marked == 11


def test_unreachable_server_is_unavailable(name: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with override_settings(DLOCK_BACKENDS={"default": {"BACKEND": REDIS, "LOCATION": url}}):
        with pytest.raises(BackendUnavailable) as excinfo:
            lock(name, timeout=0).acquire()  # with a timeout it would be retried till then
    assert excinfo.value.backend == "default"


def test_a_retried_acquire_returns_the_token_it_won(name: str) -> None:
    """If the reply to ACQUIRE is lost and the client retries, it must not be refused."""
    backend = locks["redis"]
    assert isinstance(backend, RedisBackend)
    first = backend.do_acquire(name, "owner-a", 30, "{}")
    again = backend.do_acquire(name, "owner-a", 30, "{}")
    answered = time.monotonic()
    other = backend.do_acquire(name, "owner-b", 30, "{}")
    assert isinstance(first, int)
    assert isinstance(again, Grant) and again.token == first
    # The retry reports the lease that is left; it does not start a new one.
    assert 29 < again.lease <= 30 and again.expires <= answered + again.lease
    assert other is None
    assert backend.do_release(name, "owner-a")


def test_scripts_are_reloaded_after_script_flush(redis_servers: dict[str, Any], name: str) -> None:
    with lock(name, backend="redis"):
        pass
    raw(redis_servers["single"]).script_flush()
    with lock(name, backend="redis") as held:
        held.extend(10)
        held.ensure()


def _fair() -> RedisBackend:
    backend = locks["redis-fair"]
    assert isinstance(backend, RedisBackend)
    return backend


def _holder_of(backend: RedisBackend, name: str) -> str | None:
    value = redis.Redis.from_url(backend.locations[0], decode_responses=True).get(
        backend._keys(name).lock
    )
    return value.split(":", 1)[0] if value else None


def test_fair_release_hands_the_lock_to_the_first_waiter(name: str) -> None:
    backend = _fair()
    assert isinstance(backend.do_acquire(name, "holder", 30, "{}"), int)
    assert backend.do_acquire(name, "first", 30, '{"who":"first"}') is None
    assert backend.do_acquire(name, "second", 30, "{}") is None
    assert backend.do_release(name, "holder")
    # Never free in between: the release itself granted it to the first waiter.
    assert _holder_of(backend, name) == "first"
    [info] = backend.list(name)
    assert info.holder == {"who": "first"}
    assert info.expires_in <= HANDOVER_LEASE_MS / 1000
    assert backend.do_release(name, "first")
    assert _holder_of(backend, name) == "second"
    assert backend.do_release(name, "second")
    assert _holder_of(backend, name) is None


def test_fair_waiter_granted_while_giving_up_passes_the_lock_on(name: str) -> None:
    backend = _fair()
    backend.do_acquire(name, "holder", 30, "{}")
    gives_up = backend.ops().attempt(name, "gives-up", 30, ({}, "{}"), True, None)
    assert gives_up.try_acquire() is None  # queued
    backend.do_acquire(name, "patient", 30, "{}")
    backend.do_release(name, "holder")
    assert _holder_of(backend, name) == "gives-up"
    gives_up.abandon()
    assert _holder_of(backend, name) == "patient"
    backend.do_release(name, "patient")


def test_fair_handed_over_lease_is_extended_to_the_full_ttl(name: str) -> None:
    holder = lock(name, backend="redis-fair").acquire()
    waiter, got = _queued_waiter(name, 1, ttl=30, timeout=30)
    holder.release()
    waiter.join(30)
    [held] = got
    client = redis.Redis.from_url(_fair().locations[0])
    assert client.pttl(_fair()._keys(name).lock) <= HANDOVER_LEASE_MS
    # The watchdog renews at a third of the short lease, with the full TTL.
    wait_for(lambda: client.pttl(_fair()._keys(name).lock) > HANDOVER_LEASE_MS, 10, "extension")
    held.ensure()
    assert held.token > holder.token
    held.release()


def test_fair_handed_over_lease_without_renewal_is_extended_at_once(name: str) -> None:
    holder = lock(name, backend="redis-fair").acquire()
    waiter, got = _queued_waiter(name, 1, ttl=30, timeout=30, renew=False)
    holder.release()
    waiter.join(30)
    [held] = got
    client = redis.Redis.from_url(_fair().locations[0])
    assert client.pttl(_fair()._keys(name).lock) > HANDOVER_LEASE_MS
    assert held.expires_in > HANDOVER_LEASE_MS / 1000
    held.release()


def test_unfair_waiter_that_waited_too_long_is_queued_and_served_next(name: str) -> None:
    backend = locks["redis"]
    assert isinstance(backend, RedisBackend)
    assert isinstance(backend.do_acquire(name, "holder", 0.3, "{}"), int)
    starving = backend.ops().attempt(name, "starving", 30, ({}, "{}"), True, None)
    assert starving.try_acquire() is None
    assert starving.since is not None
    starving.since -= 1  # as if it had waited 1 s
    assert starving.try_acquire() is None
    assert starving.queued_at is not None
    time.sleep(0.5)  # the holder's lease runs out without a release
    # The lock is free, but a newcomer may not barge ahead of the queued waiter:
    # its refused attempt hands the lock to that waiter (issue 16).
    assert backend.do_acquire(name, "newcomer", 30, "{}") is None
    assert _holder_of(backend, name) == "starving"
    granted = starving.try_acquire()
    assert isinstance(granted, Grant) and granted.lease <= HANDOVER_LEASE_MS / 1000
    assert backend.do_release(name, "starving")


def test_unfair_release_hands_over_to_a_queued_waiter(name: str) -> None:
    backend = locks["redis"]
    assert isinstance(backend, RedisBackend)
    backend.do_acquire(name, "holder", 30, "{}")
    starving = backend.ops().attempt(name, "starving", 30, ({}, "{}"), True, None)
    starving.try_acquire()
    assert starving.since is not None
    starving.since -= 1
    starving.try_acquire()
    assert backend.do_release(name, "holder")
    value = redis.Redis.from_url(backend.locations[0], decode_responses=True).get(
        backend._keys(name).lock
    )
    assert value.split(":", 1)[0] == "starving"
    assert backend.do_release(name, "starving")


@pytest.mark.parametrize("alias", ["redis", "redis-fair"])
def test_no_thread_starves(alias: str, name: str) -> None:
    turns = dict.fromkeys(range(8), 0)
    stop = time.monotonic() + 2.0

    def worker(i: int) -> None:
        while time.monotonic() < stop:
            with lock(name, backend=alias, timeout=30):
                turns[i] += 1
                time.sleep(0.001)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert min(turns.values()) >= 1, turns


def test_redlock_waiters_never_queue(name: str) -> None:
    """A queue on each master would hand the lock over master by master, not by majority."""
    backend = locks["redlock"]
    assert isinstance(backend, RedlockBackend)
    assert isinstance(backend.do_acquire(name, "holder", 30, "{}"), Grant | int)
    waiter = backend.ops().attempt(name, "waiter", 30, ({}, "{}"), True, None)
    assert waiter.try_acquire() is None
    assert waiter.since is not None
    waiter.since -= 10  # long past STARVE_AFTER
    assert waiter.try_acquire() is None
    for node in backend.nodes:
        try:
            assert node.command("EXISTS", backend._keys(name).queue) == 0
        except redis.RedisError:
            continue  # the stopped master
    assert backend.do_release(name, "holder")


@pytest.mark.parametrize("alias", ["redis", "redis-cluster", "redlock", "redis-django"])
def test_list_reads_the_index_page_by_page(
    alias: str, name: str, redis_servers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_dlock.backends.redis import listing

    monkeypatch.setattr(listing, "LIST_PAGE", 3)
    held = [lock(f"{name}:{i:02d}", backend=alias).acquire() for i in range(10)]
    try:
        listed = locks[alias].list(name)
        assert [(i.name, i.token) for i in listed] == [(h.name, h.token) for h in held]
        # Page after page on one connection: it is still in step afterwards.
        assert [i.name for i in locks[alias].list(f"{name}:05")] == [f"{name}:05"]
    finally:
        for h in held:
            h.release()


def test_a_listing_stopped_midway_leaves_the_connection_usable(
    name: str, redis_servers: dict[str, Any]
) -> None:
    backend = locks["redis"]
    assert isinstance(backend, RedisBackend)
    with lock(f"{name}:a", backend="redis"), lock(f"{name}:b", backend="redis") as b:
        node = backend.nodes[0]
        tag = backend._tags[0]
        low, high = f"[{name}".encode(), f"({name}\xff".encode("utf-8", "surrogateescape")
        pages = node.pages(node.list, [f"{tag}:idx"], [low, high, f"{tag}:lock:", 1])
        first = next(pages)  # the second page's call is on its way
        assert first[2] == f"{name}:a".encode()
        pages.close()
        assert backend.do_check(b.name, b.owner)


def test_a_holder_that_is_not_json_is_listed_as_unparsed(
    redis_servers: dict[str, Any], name: str
) -> None:
    from django_dlock.management.formatting import as_json

    client = raw(redis_servers["single"])
    with lock(f"{name}:ok", backend="redis"):
        # A value written by hand, as an operator might with redis-cli.
        client.set(
            f"{{dlock:0}}:lock:{name}:odd", "someone:42:1700000000000000:not json", px=30_000
        )
        client.zadd("{dlock:0}:idx", {f"{name}:odd": 0})
        listed = {info.name: info for info in locks["redis"].list(name)}
        assert listed[f"{name}:odd"].holder == {"unparsed": "not json"}
        assert listed[f"{name}:odd"].token == 42
        assert "pid" in listed[f"{name}:ok"].holder
        now = datetime.now(timezone.utc)
        items = [json.loads(as_json(info, now)) for info in listed.values()]
        assert {item["name"]: item["holder"].get("unparsed") for item in items} == {
            f"{name}:ok": None,
            f"{name}:odd": "not json",
        }
    locks["redis"].break_lock(f"{name}:odd")


# --- a server that stalls: retries after a socket timeout (issue 15) -------------------------


class _Stalled:
    """A redis-server of the test's own behind a proxy that can hold its replies.

    The server runs each command at once; a held reply makes the client's
    socket timeout fire on a command that did take effect, and the client
    cannot know whether it did. (A server frozen with SIGSTOP does not make
    this reproducible: whether it runs a command from a connection the
    client has closed since is up to the kernel.)
    """

    def __init__(self) -> None:
        self.server = RedisServer(free_port()).start()
        self.proxy = Proxy(self.server.port)

    def backend(self, alias: str, *, direct: bool = False, **options: Any) -> RedisBackend:
        url = self.server.url if direct else self.proxy.url
        return RedisBackend(alias, {"LOCATION": url, "OPTIONS": options})

    def stall(self, seconds: float) -> None:
        self.proxy.stall_replies(seconds)

    @staticmethod
    def load_scripts(backend: RedisBackend) -> None:
        """Run each script once: a command answered NOSCRIPT would not have taken effect."""
        backend.acquire("warm-up", timeout=0).release()
        backend.break_lock("warm-up")

    def cleanup(self) -> None:
        self.proxy.close()
        self.server.cleanup()


@pytest.fixture
def stalled() -> Iterator[_Stalled]:
    server = _Stalled()
    yield server
    server.cleanup()


def test_a_resent_release_is_not_reported_lost(stalled: _Stalled, name: str) -> None:
    from django_dlock.signals import lock_lost

    backend = stalled.backend("stall", socket_timeout=0.3)
    stalled.load_scripts(backend)
    lost: list[Any] = []
    lock_lost.connect(lambda **kw: lost.append(kw), weak=False, dispatch_uid="stall-release")
    try:
        held = backend.acquire(name, ttl=30, renew=False)
        stalled.stall(0.4)  # past the timeout, not its resend: the release is resent
        held.release()
    finally:
        lock_lost.disconnect(dispatch_uid="stall-release")
    assert held.released and lost == []
    assert backend.list(name) == []


def test_a_break_resent_after_a_timeout_does_not_break_the_next_holder(
    stalled: _Stalled, name: str
) -> None:
    """Fair mode hands the lock on within the break; a resent break must not break that too."""
    breaker = stalled.backend("stall", socket_timeout=0.3, fair=True)
    patient = stalled.backend("stall", direct=True, fair=True)
    stalled.load_scripts(breaker)
    first = patient.acquire(name, ttl=30, renew=False)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(patient.acquire(name, timeout=30)))
    waiter.start()
    client = raw(stalled.server)
    wait_for(lambda: client.llen(patient._keys(name).queue) == 1, 10, "the waiter queued")
    stalled.stall(0.4)  # past the timeout, not its resend: the break is resent
    assert breaker.break_lock(name) is True
    waiter.join(timeout=30)
    [second] = got
    assert second.token > first.token
    second.ensure()  # handed the lock by the break, and not broken by its resend
    [info] = patient.list(name)
    assert info.token == second.token
    second.release()


def test_a_first_attempt_that_timed_out_leaves_no_lease(stalled: _Stalled, name: str) -> None:
    """The attempt ran on the server after the client gave up; it must be released."""
    backend = stalled.backend("stall", socket_timeout=0.3)
    stalled.load_scripts(backend)
    stalled.stall(0.8)  # longer than the attempt and its one resend
    with pytest.raises(BackendUnavailable):
        backend.acquire(name, ttl=30, timeout=0)
    deadline = time.monotonic() + 5
    while backend.list(name):
        assert time.monotonic() < deadline, f"a lease nobody holds: {backend.list(name)}"
        time.sleep(0.05)
    backend.acquire(name, ttl=30, timeout=0).release()


def test_redlock_rides_out_a_master_that_never_answers(name: str) -> None:
    """A master that accepts connections and never answers must cost one timeout, not every call.

    Issue 15: on defaults (socket timeout 5 s) 7 locks took 35 s to acquire,
    then every lease was lost, though two of three masters answered.
    """
    import socket

    masters = [RedisServer(free_port()).start() for _ in range(2)]
    hole = socket.create_server(("127.0.0.1", 0), backlog=128)  # never accepts, never answers
    backend = RedlockBackend(
        "hole",
        {
            "BACKEND": REDLOCK,
            "LOCATION": [
                *(m.url for m in masters),
                f"redis://127.0.0.1:{hole.getsockname()[1]}/0",
            ],
        },
    )
    try:
        held = [backend.acquire(f"{name}:{i}", ttl=2, timeout=20) for i in range(7)]
        time.sleep(5)  # two and a half TTLs: each lease renewed at ttl/3 meanwhile
        for each in held:
            assert not each.lost, each.lost_reason
            each.ensure()
        for each in held:
            each.release()
    finally:
        backend.close()
        hole.close()
        for master in masters:
            master.cleanup()


@pytest.mark.multiprocess
def test_redlock_works_in_a_forked_child(redis_servers: dict[str, Any], name: str) -> None:
    """Review of issue 15: a child forked after the parent used Redlock inherited its pools.

    Their threads do not survive fork(), so the child's calls queued for ever
    and every master looked stuck (BackendUnavailable after 5 s). Celery's
    prefork pool and gunicorn --preload fork exactly so.
    """
    with lock(f"{name}:parent", backend="redlock", timeout=5):
        pass
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        outcome = b"?"
        try:
            with lock(f"{name}:child", backend="redlock", timeout=5) as held:
                held.ensure()
                outcome = b"ok"
        except BaseException as e:
            outcome = repr(e).encode()[:500]
        finally:
            os.write(write_end, outcome)
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        assert pipe.read() == b"ok"
    with lock(f"{name}:parent", backend="redlock", timeout=5):  # and the parent still works
        pass


# --- waking when a lease ends, and hand-overs to waiters that stopped (issue 16) -------------

# A process that takes a lock and keeps it until it is killed (or stopped with
# SIGSTOP while it waits for it). DLOCK_HOLDER: JSON with "backend" (a
# DLOCK_BACKENDS entry), "name", "ttl", "renew", "timeout". Prints one line
# when it holds the lock.
_HOLDER = """
import json, os, time
import django
from django.conf import settings
config = json.loads(os.environ["DLOCK_HOLDER"])
settings.configure(INSTALLED_APPS=["django_dlock"], DLOCK_BACKENDS={"default": config["backend"]})
django.setup()
from django_dlock import lock
held = lock(
    config["name"], ttl=config["ttl"], renew=config["renew"], timeout=config["timeout"]
).acquire()
print(held.token, flush=True)
time.sleep(120)
"""


def _lock_process(alias: str, name: str, **options: Any) -> subprocess.Popen[str]:
    """A process that acquires ``name`` on ``alias`` (see _HOLDER); it is not waited for."""
    from django.conf import settings

    config = {
        "backend": settings.DLOCK_BACKENDS[alias],
        "name": name,
        "ttl": 30,
        "renew": True,
        "timeout": 60,
        **options,
    }
    return subprocess.Popen(
        [sys.executable, "-c", _HOLDER],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DLOCK_HOLDER": json.dumps(config)},
    )


def _kill(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=20)
    if process.stdout is not None:
        process.stdout.close()


def _lease_end(alias: str, name: str) -> float:
    """When the lease on ``name`` ends, by our clock, from its PTTL on the server(s).

    Redlock: the lease holds while a majority of masters hold it; with one of
    three down, that ends at the earlier expiry of the two live ones.
    """
    backend = locks[alias]
    assert isinstance(backend, RedisLocks)
    ends = []
    for node in backend.nodes:
        before = time.monotonic()
        try:
            pttl = int(node.command("PTTL", backend._keys(name).lock))
        except redis.RedisError:
            continue  # Redlock's stopped master
        if pttl > 0:
            ends.append((before + time.monotonic()) / 2 + pttl / 1000)
    assert ends, f"{name!r} is not held on {alias!r}"
    return min(ends)


@pytest.mark.multiprocess
@pytest.mark.parametrize("alias", ["redis", "redis-fair", "redlock", "redis-cluster"])
def test_a_waiter_takes_the_lock_when_a_killed_holders_lease_ends(alias: str, name: str) -> None:
    """Issue 16: waiters took the lock about a second after a SIGKILLed holder's lease ended."""
    holder = _lock_process(alias, name, ttl=4, renew=False)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip()
        got: list[tuple[Any, float]] = []
        waiter = threading.Thread(
            target=lambda: got.append(
                (lock(name, backend=alias, timeout=30).acquire(), time.monotonic())
            )
        )
        waiter.start()
        time.sleep(1.0)  # the waiter has been refused and blocks
        ends = _lease_end(alias, name)
        os.kill(holder.pid, signal.SIGKILL)
    finally:
        _kill(holder)
    waiter.join(30)
    [(held, at)] = got
    held.release()
    print(f"{alias}: lag {at - ends:.3f}s")
    assert at - ends < 0.3, f"took the lock {at - ends:.2f}s after the lease ended"


def test_a_refusal_in_the_holders_last_millisecond_rechecks_just_after_it(name: str) -> None:
    """CI, stop 39: a refusal whose PTTL read 0 (the holder's lease in its last
    millisecond) was taken for "unknown" and waited WAIT_CAP, a second, for a
    wake-up that an expiry never pushes (the killed-holder test above lagged 1.00 s)."""
    backend = locks["redis"]
    assert isinstance(backend, RedisLocks)
    _, attempt, _, _ = backend._begin(name, 5, None, None, True, None, 1, None)
    assert backend._outcome(-1, attempt, time.monotonic()) is None  # the script's "PTTL 0"
    assert attempt.holder_pttl_ms == 0
    plan = backend._wait_plan(attempt, None)
    assert plan is not None and plan[1] <= 0.002, plan


def _lines(process: subprocess.Popen[str]) -> list[str]:
    """The lines ``process`` prints, collected by a thread as they come."""
    lines: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.strip())

    threading.Thread(target=read, name="test-reader", daemon=True).start()
    return lines


@pytest.mark.multiprocess
def test_a_stopped_waiter_handed_the_lock_stalls_the_queue_briefly(name: str) -> None:
    """Issue 16: a fair waiter frozen as it was handed the lock held everyone up 3 s.

    The hand-over lease is now HANDOVER_LEASE_MS (1 s); the waiter behind it
    takes the lock when that runs out. The stopped waiter, resumed, finds the
    lease it was handed gone: it queues again instead of believing it holds
    the lock, and is served after the waiter that took its turn.
    """
    backend = _fair()
    holder = lock(name, backend="redis-fair").acquire()
    frozen = _lock_process("redis-fair", name, ttl=30, timeout=60)
    try:
        said = _lines(frozen)
        wait_for(lambda: len(_queue(name)) == 1, 30, "the process queued")
        waiter, got = _queued_waiter(name, 2, timeout=30)
        os.kill(frozen.pid, signal.SIGSTOP)
        released = time.monotonic()
        holder.release()  # hands the lock to the stopped process
        waiter.join(30)
        stall = time.monotonic() - released
        [held] = got
        assert stall < HANDOVER_LEASE_MS / 1000 + 0.8, f"the queue stalled {stall:.2f}s"
        os.kill(frozen.pid, signal.SIGCONT)
        time.sleep(1.0)  # it reads the hand-over it slept through, and asks the server
        assert said == [], "the resumed process believes it holds the lock"
        held.ensure()
        assert len(_queue(name)) == 1, "the resumed process did not queue again"
        held.release()  # its turn now
        wait_for(lambda: bool(said), 10, "the resumed process took its turn")
        assert int(said[0]) > held.token
    finally:
        _kill(frozen)
        backend.break_lock(name)


# --- semaphores, read/write locks and parked tasks (issue 18) ---------------------------------


def _sem_keys(backend_alias: str, name: str) -> dict[str, str]:
    backend = locks[backend_alias]
    assert isinstance(backend, RedisBackend)
    kinds = ("h", "i", "w", "wi", "ww", "m", "wake", "fence", "idx")
    return dict(zip(kinds, backend.slot_keys(name).slots, strict=True))


def test_the_slot_scripts_copies_of_their_helpers_agree() -> None:
    copies: dict[str, set[str]] = {}
    for script in slot_scripts.ALL.values():
        for fn, body in _lua_functions(script.text).items():
            copies.setdefault(fn, set()).add(body)
    assert {"prune", "touch", "wake", "settle"} <= set(copies)
    assert {fn: len(bodies) for fn, bodies in copies.items()} == dict.fromkeys(copies, 1)


def test_the_slot_scripts_use_the_constants_they_name() -> None:
    values = {"WAKE_MAX": slot_scripts.WAKE_MAX, "SIGNAL_TTL_MS": SIGNAL_TTL_MS}
    marked = 0
    for script in slot_scripts.ALL.values():
        for line in script.text.splitlines():
            code, _, comment = line.partition("--")
            for constant, value in values.items():
                if comment.strip() == constant:
                    marked += 1
                    assert str(value) in code, line
    assert marked == 6


def test_slot_keys_are_as_documented(redis_servers: dict[str, Any], name: str) -> None:
    client = raw(redis_servers["single"])
    k = _sem_keys("redis", name)
    assert k["h"] == f"{{dlock:0}}:sem:h:{name}" and k["fence"] == "{dlock:0}:sem:fence"
    with semaphore(name, limit=2, backend="redis", metadata={"note": "docs"}) as held:
        assert 0 < client.zscore(k["h"], held.owner) - time.time() * 1000 <= 30_000 + 1000
        token, weight, acquired_us, holder = client.hget(k["i"], held.owner).split(":", 3)
        assert (int(token), int(weight)) == (held.token, 1) and int(acquired_us) > 0
        assert '"note":"docs"' in holder
        assert client.hget(k["m"], "limit") == "2"
        assert int(client.hget(k["fence"], name)) == held.token
        assert client.zscore(k["idx"], name) == 0
        for kind in ("h", "i", "m"):
            assert 0 < client.pttl(k[kind]) <= 30_000, kind
        assert client.exists(f"{{dlock:0}}:lock:{name}") == 0  # the mutex's keyspace is apart
    # The index is shared by every semaphore (others of this worker's tests may
    # be in it); this one's entry goes, below.
    assert [key for key in k.values() if key != k["idx"] and client.exists(key)] == [k["fence"]]
    assert int(client.hget(k["fence"], name)) == held.token
    assert client.zscore(k["idx"], name) is None


def test_an_abandoned_semaphore_vanishes(redis_servers: dict[str, Any], name: str) -> None:
    """Its holder and a waiter died: every key but the fence expires by itself."""
    client = raw(redis_servers["single"])
    k = _sem_keys("redis", name)
    semaphore(name, limit=1, backend="redis", ttl=0.3, renew=False).acquire()
    backend = locks["redis"]
    assert backend.do_acquire_slot(name, "dead-waiter", 0.4, "{}", False, 1, 1) is None
    assert client.exists(k["w"]) and client.exists(k["wi"])
    kinds = ["h", "i", "w", "wi", "ww", "m"]
    wait_for(lambda: not any(client.exists(k[kind]) for kind in kinds), 5, "the keys expired")
    assert client.hget(k["fence"], name) is not None
    assert backend.semaphores(name) == []


@pytest.mark.parametrize("alias", ["redis", "redis-cluster"])
def test_a_slot_waiter_is_woken_by_a_release(alias: str, name: str) -> None:
    """The waiter blocks on the wake list; a release wakes it at once.

    Its wait is bounded by WAIT_CAP (1 s) here (ttl/3 is 10 s, the holder's
    lease 30 s): it is released 0.3 s into a wait, so a waiter that was not
    woken would take the slot 0.7 s after the release at the earliest.
    """
    backend = locks[alias]
    first = semaphore(name, limit=1, backend=alias, ttl=30).acquire()
    got: list[Any] = []
    waiter = threading.Thread(
        target=lambda: got.append(semaphore(name, limit=1, backend=alias, ttl=30).acquire())
    )
    waiter.start()
    try:
        wait_for(lambda: any(i.waiting for i in backend.semaphores(name)), 10, "the waiter")
        time.sleep(0.3)
        released = time.monotonic()
        first.release()
        wait_for(lambda: bool(got), 10, "the waiter took the slot")
        took = time.monotonic() - released
        assert took < 0.35, f"the waiter took {took:.2f}s to notice the release"
        assert got[0].token > first.token
    finally:
        waiter.join(10)
        for held in got:
            held.release()


def test_slot_tokens_survive_a_restart_that_loses_data(
    redis_servers: dict[str, Any], name: str
) -> None:
    server = redis_servers["single"]
    with semaphore(name, limit=3, backend="redis") as before:
        pass
    server.restart()  # --save "" --appendonly no: everything is gone
    assert raw(server).dbsize() == 0
    with semaphore(name, limit=3, backend="redis") as after:
        assert after.token > before.token
    raw(server).flushall()
    with semaphore(name, limit=3, backend="redis") as flushed:
        assert flushed.token > after.token
    # An older snapshot: the fence restored lower than the last token issued.
    raw(server).hset(_sem_keys("redis", name)["fence"], name, 5)
    with rwlock(name, backend="redis").write() as older:
        assert older.token > flushed.token


def test_cluster_keys_of_a_semaphore_share_one_slot(redis_servers: dict[str, Any]) -> None:
    backend = locks["redis-cluster"]
    assert isinstance(backend, RedisBackend)
    port = redis_servers["cluster"][0].port
    for i in range(20):
        keys = backend.slot_keys(f"sem-slot-test:{i}:{{odd}}")
        slots = {
            redis_cli(port, "cluster", "keyslot", key).strip()
            for key in (*keys.slots, *keys.park, keys.done_prefix + "x")
        }
        assert len(slots) == 1, slots


def test_cluster_lists_semaphores_and_parked_tasks_over_masters(
    redis_servers: dict[str, Any], name: str
) -> None:
    backend = locks["redis-cluster"]
    names = [f"{name}:{i}" for i in range(16)]
    held = [semaphore(n, limit=2, backend="redis-cluster").acquire() for n in names]
    try:
        per_master = [
            len(redis.Redis(port=s.port).keys(f"*:sem:h:{name}:*"))
            for s in redis_servers["cluster"]
        ]
        assert sum(1 for count in per_master if count) >= 2, per_master
        assert [i.name for i in backend.semaphores(name)] == sorted(names)
        for i, n in enumerate(names):
            backend.do_park(n, f"task-{i}", i, "{}")
        assert sorted(p.name for p in backend.do_list_parked(name)) == sorted(names)
    finally:
        for h in held:
            h.release()
        for n in names:
            backend.do_unpark(n, 10)
    assert backend.semaphores(name) == []


def test_a_resent_unpark_loses_no_task(stalled: _Stalled, name: str) -> None:
    """t0 UNPARK pops a task, t1 its reply is held past the socket timeout, t2 the
    client resends it: the resend must answer with that task, not pop the next."""
    backend = stalled.backend("stall", socket_timeout=0.3)
    for i, key in enumerate("abc"):
        backend.do_park(name, key, i, f'{{"n": "{key}"}}')
    backend.do_unpark(f"{name}:warm-up", 1)  # the script is loaded: no NOSCRIPT below
    stalled.stall(0.4)  # past the timeout, not its resend
    assert [p.key for p in backend.do_unpark(name, 1)] == ["a"]
    assert [p.key for p in backend.do_list_parked(name)] in (["b", "c"], ["c", "b"])
    stalled.stall(0.4)
    assert backend.do_unpark_key(name, "b") is True  # resent: still the one that took it
    assert backend.do_unpark_key(name, "b") is False
    assert [p.key for p in backend.do_unpark(name, 5)] == ["c"]


def test_a_resent_slot_release_is_not_reported_lost(stalled: _Stalled, name: str) -> None:
    backend = stalled.backend("stall", socket_timeout=0.3)
    backend.acquire("warm-up", limit=2, timeout=0).release()
    held = backend.acquire(name, limit=2, ttl=30, renew=False)
    stalled.stall(0.4)
    assert backend.do_release_slot(name, held.owner) is True
    assert backend.semaphores(name) == []
