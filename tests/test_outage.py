"""``acquire()`` rides out an outage of the lock service (issue 16).

A fault run restarted Redis under waiters with ``timeout=10``: each raised
``BackendUnavailable`` at once. Now an attempt that fails is retried with
backoff until the timeout, and only then is the last error raised;
``timeout=0`` fails fast, and so does what no retry fixes (a wrong password).
Real servers, stopped and started again: a Redis of the test's own, and
PostgreSQL behind a TCP proxy (tests/netproxy.py) whose upstream the test cuts
and restores. etcd's are in tests/test_etcd.py, which owns etcd members.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings

from django_dlock import BackendUnavailable, lock
from django_dlock.backends.base import BaseLockBackend
from django_dlock.backends.database import DatabaseBackend
from django_dlock.backends.redis import RedisBackend
from tests.netproxy import Proxy
from tests.servers import RedisServer, free_port, redis_cli

REDIS = "django_dlock.backends.redis.RedisBackend"
#: The outage the tests make, and how long ``acquire`` may wait it out.
DOWN_FOR = 1.0
TIMEOUT = 15.0


@contextlib.contextmanager
def _after(seconds: float, action: Callable[[], Any]) -> Iterator[None]:
    """Run ``action`` on a thread ``seconds`` into the block; the block ends when it has."""

    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, name="test-outage")
    thread.start()
    try:
        yield
    finally:
        thread.join(60)


def _down_for_the_whole_timeout(backend: BaseLockBackend, name: str) -> None:
    """With the service down throughout, ``acquire`` raises only once its timeout is spent."""
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match=r"retried for \d") as excinfo:
        backend.acquire(name, timeout=2)
    elapsed = time.monotonic() - started
    assert elapsed >= 0.8 * 2, f"gave up after {elapsed:.2f}s of a 2s timeout"
    assert excinfo.value.transient and excinfo.value.backend == backend.alias
    # timeout=0 is how a caller asks to fail fast: one try, no retry.
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as excinfo:
        backend.acquire(name, timeout=0)
    assert time.monotonic() - started < 1.5
    assert "retried" not in str(excinfo.value)


# --- Redis ----------------------------------------------------------------------------


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port()).start()
    yield server
    server.cleanup()


@pytest.mark.parametrize("fair", [False, True], ids=["unfair", "fair"])
def test_redis_restart_is_ridden_out(redis_server: RedisServer, name: str, fair: bool) -> None:
    """A waiter refused by a holder, the server restarted under it: it gets the lock after."""
    backend = RedisBackend("outage", {"LOCATION": redis_server.url, "OPTIONS": {"fair": fair}})
    try:
        holder = backend.acquire(name, ttl=30, renew=False)
        got: list[Any] = []
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                got.append(backend.acquire(name, timeout=TIMEOUT))
            except BaseException as e:  # reported by the assertion below
                errors.append(e)

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.3)  # refused, and waiting
        redis_server.stop()  # --save "": the holder's lease is gone with the data
        with _after(DOWN_FOR, redis_server.start):
            thread.join(TIMEOUT + 10)
        assert not errors, errors
        [held] = got
        held.ensure()
        assert held.token > holder.token
        held.release()
    finally:
        backend.close()


def test_redis_first_attempt_during_a_restart_is_retried(
    redis_server: RedisServer, name: str
) -> None:
    backend = RedisBackend("outage", {"LOCATION": redis_server.url})
    try:
        backend.acquire(name, timeout=0).release()  # connected before the outage
        redis_server.stop()
        with _after(DOWN_FOR, redis_server.start):
            started = time.monotonic()
            held = backend.acquire(name, timeout=TIMEOUT)
            elapsed = time.monotonic() - started
        assert elapsed >= DOWN_FOR * 0.8, "acquired while the server was down?"
        held.ensure()
        held.release()
        assert backend.list(name) == []
    finally:
        backend.close()


def test_redis_async_acquire_rides_out_a_restart(redis_server: RedisServer, name: str) -> None:
    """The native asyncio path shares the loop: it retries the same way."""
    setting = {"default": {"BACKEND": REDIS, "LOCATION": redis_server.url}}

    async def scenario() -> int:
        held = await lock(name, timeout=TIMEOUT).aacquire()
        await held.aensure()
        await held.arelease()
        return held.token

    with override_settings(DLOCK_BACKENDS=setting):
        from django_dlock import locks

        assert locks["default"].native_async
        redis_server.stop()
        try:
            with _after(DOWN_FOR, redis_server.start):
                assert asyncio.run(scenario()) > 0
        finally:
            locks["default"].close()


def test_redis_down_for_the_whole_timeout(redis_server: RedisServer, name: str) -> None:
    backend = RedisBackend("outage", {"LOCATION": redis_server.url})
    try:
        redis_server.stop()
        _down_for_the_whole_timeout(backend, name)
    finally:
        backend.close()


def test_redis_wrong_password_is_raised_at_once(name: str) -> None:
    server = RedisServer(free_port(), "--requirepass", "s3cret").start()
    backend = RedisBackend("outage", {"LOCATION": f"redis://:wrong@127.0.0.1:{server.port}/0"})
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as excinfo:
            backend.acquire(name, timeout=TIMEOUT)
        assert time.monotonic() - started < 3, "a wrong password was retried"
        assert excinfo.value.transient is False
        # No password at all: NOAUTH, the same.
        nopass = RedisBackend("outage", {"LOCATION": server.url})
        with pytest.raises(BackendUnavailable) as excinfo:
            nopass.acquire(name, timeout=TIMEOUT)
        assert excinfo.value.transient is False
        nopass.close()
    finally:
        backend.close()
        server.cleanup()


def test_redis_errors_no_retry_fixes_are_raised_at_once(
    redis_server: RedisServer, name: str
) -> None:
    """A script error fails every time: not retried (it was, until the timeout or for ever)."""
    backend = RedisBackend("outage", {"LOCATION": redis_server.url})
    try:
        for ttl in (1e20, None):
            if ttl is None:
                # A key of the wrong type where the fencing counters live.
                backend.acquire("warm-up", timeout=0).release()
                fence = next(k for k in redis_keys(redis_server) if k.endswith(":fence"))
                redis_cli(redis_server.port, "DEL", fence)
                redis_cli(redis_server.port, "SET", fence, "oops")
            started = time.monotonic()
            with pytest.raises(BackendUnavailable) as excinfo:
                backend.acquire(name, ttl=ttl, timeout=None)
            assert time.monotonic() - started < 3, f"retried: {excinfo.value}"
            assert excinfo.value.transient is False
    finally:
        backend.close()


def redis_keys(server: RedisServer) -> list[str]:
    return redis_cli(server.port, "--scan").split()


_SQLITE_MISSING = """
import sys, time
import django
from django.conf import settings
settings.configure(
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": sys.argv[1]}},
    INSTALLED_APPS=["django_dlock"], USE_TZ=True,
)
django.setup()
from django_dlock import BackendUnavailable, lock
started = time.monotonic()
try:
    with lock("x", timeout=15):
        print("acquired")
except BackendUnavailable as e:
    took = time.monotonic() - started
    print(f"BackendUnavailable transient={e.transient} after {took:.2f}s: {e}")
"""


def test_sqlite_file_that_cannot_be_opened_is_raised_at_once(tmp_path: Any) -> None:
    """Django's own OperationalError escaped before (the file is opened outside the try)."""
    missing = tmp_path / "no-such-dir" / "locks.sqlite3"
    out = subprocess.run(
        [sys.executable, "-c", _SQLITE_MISSING, str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.startswith("BackendUnavailable transient=False after 0."), (
        out.stdout + out.stderr
    )
    assert "unable to open database file" in out.stdout


# --- PostgreSQL through a proxy whose upstream is cut ------------------------------------

needs_postgresql = pytest.mark.skipif(
    "postgresql" not in settings.DATABASES,
    reason=settings.UNAVAILABLE_BACKENDS.get("db-postgresql", "no PostgreSQL"),
)


class _Cut:
    """The PostgreSQL test database reached through a proxy whose upstream can be cut.

    The "postgresql" alias's settings point at the proxy while this lasts
    (every thread's connection to it shares that settings dict). ``cut()``
    closes this thread's connection and points the proxy at a port nobody
    listens on: each new connection is accepted and dropped at once, as by a
    server that is down. ``restore()`` points it at PostgreSQL again.
    """

    DEAD = ("127.0.0.1", free_port())

    def __init__(self, **overrides: Any) -> None:
        self.settings = connections["postgresql"].settings_dict
        self.saved = {key: self.settings[key] for key in ("HOST", "PORT", *overrides)}
        self.upstream = (str(self.settings["HOST"]), int(self.settings["PORT"] or 5432))
        self.proxy = Proxy(self.upstream[1])
        connections["postgresql"].close()
        self.settings.update(HOST="127.0.0.1", PORT=str(self.proxy.port), **overrides)
        self.backend = DatabaseBackend("pg-outage", {"OPTIONS": {"database": "postgresql"}})

    def cut(self) -> None:
        connections["postgresql"].close()
        self.proxy.target = self.DEAD

    def restore(self) -> None:
        self.proxy.target = self.upstream

    def close(self) -> None:
        self.backend.close()
        connections["postgresql"].close()
        self.settings.update(self.saved)
        self.proxy.close()


@pytest.fixture
def postgresql_cut() -> Iterator[_Cut]:
    cut = _Cut()
    yield cut
    cut.close()


@needs_postgresql
@pytest.mark.django_db(transaction=True, databases=["default", "postgresql"])
def test_postgresql_outage_is_ridden_out(postgresql_cut: _Cut, name: str) -> None:
    backend = postgresql_cut.backend
    backend.acquire(name, timeout=0).release()  # the table is there, the proxy works
    postgresql_cut.cut()
    with pytest.raises(BackendUnavailable):
        backend.acquire(name, timeout=0)  # it is down
    with _after(DOWN_FOR, postgresql_cut.restore):
        held = backend.acquire(name, timeout=TIMEOUT)
    held.ensure()
    held.release()
    assert backend.list(name) == []


@needs_postgresql
@pytest.mark.django_db(transaction=True, databases=["default", "postgresql"])
def test_postgresql_down_for_the_whole_timeout(postgresql_cut: _Cut, name: str) -> None:
    postgresql_cut.cut()
    _down_for_the_whole_timeout(postgresql_cut.backend, name)


@needs_postgresql
@pytest.mark.django_db(transaction=True, databases=["default", "postgresql"])
def test_postgresql_unknown_role_is_raised_at_once(name: str) -> None:
    cut = _Cut(USER="dlock_no_such_role")
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="dlock_no_such_role") as excinfo:
            cut.backend.acquire(name, timeout=TIMEOUT)
        assert time.monotonic() - started < 3, "a refused login was retried"
        assert excinfo.value.transient is False
    finally:
        cut.close()


def test_outage_backoff_grows_to_a_second_and_no_further() -> None:
    from django_dlock.backends.base import OUTAGE_BACKOFF_CEILING, outage_backoff

    assert outage_backoff(0) <= 0.002
    assert all(0 < outage_backoff(n) <= OUTAGE_BACKOFF_CEILING for n in range(2000))
    assert outage_backoff(10**6) >= OUTAGE_BACKOFF_CEILING / 2  # no overflow at length
