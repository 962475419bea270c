"""Connections to one Redis deployment (a server, or a cluster) and the scripts run on it."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import redis
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    BusyLoadingError,
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:
    from hiredis import pack_command
except ImportError:  # redis-py packs the commands itself then
    pack_command = None  # type: ignore[assignment]

from .scripts import (
    ABANDON,
    ACQUIRE,
    ADOPT,
    BREAK,
    EXTEND,
    EXTEND_MANY,
    GET,
    LIST,
    RELEASE,
    LuaScript,
)

#: Errors that say the server refused who we are or what we may do: acquire
#: does not retry them (see BackendUnavailable.transient).
_REFUSED_WHO = (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    NoPermissionError,
)

#: Errors that ``acquire()`` retries while its timeout lasts.
_TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ClusterDownError,
    TryAgainError,
)


#: What a redis-py client raises for a call that failed. A Cluster client's
#: RedisClusterException is not a RedisError: it is what a client whose
#: cluster cannot be reached raises (its first call, and any call once every
#: node it knew of is down), and it is a lock service that is down like any
#: other (``BackendUnavailable``).
CLIENT_ERRORS = (RedisError, RedisClusterException)


def transient(error: BaseException) -> bool:
    """Whether waiting may cure ``error`` (``BackendUnavailable.transient``).

    NOAUTH, WRONGPASS, NOPERM: only new settings (or ACLs) fix these. Only a
    server that did not answer, or is loading or failing over, is worth
    waiting for; a script error (a TTL out of range, a key of the wrong
    type) or a refused login fails every time. A Cluster client that could
    reach no node says why in the error it raises from (a refused
    connection: transient; cluster mode off on that server: not); slots not
    all covered is a cluster forming or failing over.
    """
    if isinstance(error, SlotNotCoveredError):
        return True
    if isinstance(error, RedisClusterException):
        cause = error.__cause__
        if cause is not None:
            return transient(cause)
        return str(error).startswith("All slots are not covered")
    return isinstance(error, _TRANSIENT) and not isinstance(error, _REFUSED_WHO)


class Node:
    """One Redis deployment (a server, or a cluster), its scripts and its connections.

    The hot commands (acquire, release, extend, check, a waiter's BLPOP) skip redis-py's
    per-command client machinery (retry wrapper, timing, metrics), which costs
    more than the round trip on loopback: they are written to a connection
    directly with redis-py's own Connection and parser. Our own clients give
    each thread a connection of its own, taken from the client's pool on the
    thread's first command and kept for its later ones (a checkout per
    command costs a lock and a poll of the socket), then given back to the
    pool when the thread ends (see ``_Lease``): threads that come and go, a
    thread per request under ASGI, reuse the connections of the ended ones,
    and the pool's ``max_connections`` bounds the threads using the backend
    at once, not all those that ever did. A django-redis client's
    connections are borrowed from, and returned to, its pool per command. A
    Cluster client keeps redis-py's path, which routes each command to its
    slot's master.
    """

    def __init__(self, client: Any, label: str, *, dedicated: bool, retries: int) -> None:
        self.client = client
        self.label = label
        self.direct = isinstance(client, redis.Redis)
        self.dedicated = dedicated
        self.retries = retries
        self._local = threading.local()
        self.acquire = ACQUIRE
        self.release = RELEASE
        self.extend = EXTEND
        self.extend_many = EXTEND_MANY
        self.adopt = ADOPT
        self.break_ = BREAK
        self.abandon = ABANDON
        self.get = GET
        self.list = LIST

    def stuck(self) -> bool:
        """Whether to set this node aside for now; only a Redlock master ever is."""
        return False

    def run(self, script: LuaScript, keys: list[Any], args: list[Any]) -> Any:
        try:
            return self.command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            # The server lost its script cache (a restart, SCRIPT FLUSH).
            if self.direct:
                self.command("SCRIPT", "LOAD", script.text)
            else:
                self.client.script_load(script.text)  # a cluster loads it on every master
            return self.command("EVALSHA", script.sha, len(keys), *keys, *args)

    def _checkout(self) -> Any:
        if not self.dedicated:
            return self.client.connection_pool.get_connection()
        lease = getattr(self._local, "lease", None)
        if lease is None or lease.pid != os.getpid():
            # A lease made before a fork is dropped: the child's pool has
            # forgotten its connection, and release() leaves it alone.
            lease = self._local.lease = _Lease(self.client.connection_pool)
        return lease.conn

    def _checkin(self, conn: Any) -> None:
        if not self.dedicated:
            self.client.connection_pool.release(conn)

    def command(self, *args: Any) -> Any:
        if not self.direct:
            return self.client.execute_command(*args)
        conn = self._checkout()
        retries = self.retries
        try:
            while True:
                try:
                    if pack_command is None:
                        conn.send_command(*args)
                    else:
                        # What send_command() sends, without redis-py's
                        # per-argument pass (a tenth of an uncontended cycle).
                        conn.send_packed_command([pack_command(args)])
                    return conn.read_response()
                except (RedisConnectionError, RedisTimeoutError):
                    conn.disconnect()
                    if not retries:
                        raise
                    retries -= 1
        except ResponseError:
            raise  # the error reply was read in full; the connection is fine
        except BaseException:
            # A reply may be half read; the next command must not read it.
            conn.disconnect()
            raise
        finally:
            self._checkin(conn)

    def pages(
        self,
        script: LuaScript,
        keys: list[Any],
        args: list[Any],
        *,
        own_connection: bool = False,
    ) -> Iterator[Any]:
        """Replies of ``script`` run page after page, as LIST pages.

        ``args[0]`` is where a page starts and ``reply[1]`` where the next
        one does (empty after the last). On our own connections the next
        page's call is sent before this page's reply is handed over, so the
        server runs it while the caller parses this one. That call is out
        while the caller holds a page: with ``own_connection`` the pages are
        read on a connection borrowed from the client's pool, not the
        thread's, so that the caller may send other commands (or read other
        listings) before it has them all.
        """
        if not self.direct:
            reply = self.run(script, keys, args)
            yield reply
            while reply[1]:
                reply = self.run(script, keys, [reply[1], *args[1:]])
                yield reply
            return
        if own_connection:
            # Borrowed from the pool and given back (disconnected if a reply
            # is still out): a connection made with make_connection and not
            # given back would count against the pool's limit for good.
            pool = self.client.connection_pool
            conn = pool.get_connection()
            try:
                yield from self._pages_on(conn, script, keys, args, self._run_on(conn))
            finally:
                pool.release(conn)
            return
        conn = self._checkout()
        try:
            yield from self._pages_on(conn, script, keys, args, self.run)
        finally:
            self._checkin(conn)

    @staticmethod
    def _run_on(conn: Any) -> Any:
        """``run`` on ``conn``: no retry, a connection made for one listing."""

        def run(script: LuaScript, keys: list[Any], args: list[Any]) -> Any:
            try:
                conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                return conn.read_response()
            except NoScriptError:
                conn.send_command("SCRIPT", "LOAD", script.text)
                conn.read_response()
                conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                return conn.read_response()

        return run

    def _pages_on(
        self, conn: Any, script: LuaScript, keys: list[Any], args: list[Any], run: Any
    ) -> Iterator[Any]:
        reply = run(script, keys, args)
        sent = False
        try:
            while reply[1]:
                conn.send_command("EVALSHA", script.sha, len(keys), *keys, reply[1], *args[1:])
                sent = True
                yield reply
                try:
                    reply = conn.read_response()
                    sent = False
                except NoScriptError:
                    sent = False  # the server lost its scripts meanwhile: load it again
                    reply = run(script, keys, [reply[1], *args[1:]])
            yield reply
        except BaseException:
            conn.disconnect()
            raise
        finally:
            if sent:
                conn.disconnect()  # the caller stopped early: a reply is on its way

    def close(self) -> None:
        lease = getattr(self._local, "lease", None)
        if lease is not None:
            self._local.lease = None
            lease.conn.disconnect()
            lease.give_back()


class _Lease:
    """A thread's connection, taken from ``pool`` and given back when the thread ends.

    Held only by the node's ``threading.local``, which drops it when its
    thread ends: ``__del__`` then runs (in the ending thread) and hands the
    connection back to the pool for the next thread. Without it every
    thread that ever ran a command kept a connection counted against the
    pool's ``max_connections`` for good, and under a thread per request the
    pool refused the 101st thread ("Too many connections").
    """

    __slots__ = ("conn", "pid", "pool")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.pid = os.getpid()
        self.conn = pool.get_connection()

    def give_back(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.release(self.conn)

    def __del__(self) -> None:
        # At interpreter shutdown the pool may be half torn down already.
        with contextlib.suppress(Exception):
            self.give_back()


def ask_version(node: Any, channel: str) -> str:
    """The server's version by ``INFO server``; by ``PING`` when the user may not run INFO.

    A hardened ACL (``-@dangerous``) denies INFO while the lock scripts are
    allowed: the server answers, and the probe after the ping tells whether
    it can lock. Then a ``PUBLISH`` on ``channel``, a wake-up channel of the
    backend's: a release publishes on one when a caller waits, and Redis 7
    gives an ACL user no channel unless told (``acl-pubsub-default``), so
    every contended release would fail where a lone lock passes the probe.
    """
    try:
        version = server_version(node.command("INFO", "server"))
    except NoPermissionError:
        node.command("PING")
        version = "unknown version (INFO is denied to this user)"
    try:
        node.command("PUBLISH", channel, "")
    except NoPermissionError as e:
        raise NoPermissionError(
            f"{e}: the user may not publish on the locks' wake-up channels, and every release "
            "that a waiter waits for would fail (give its ACL &* or the channels under the "
            "backend's KEY_PREFIX: Redis 7 gives a new user none)"
        ) from e
    return version


def server_version(info: Any) -> str:
    """``redis_version`` from an INFO reply.

    The reply is raw text from our own connection, or redis-py's parsed dict
    (a cluster client's is keyed by node).
    """
    if isinstance(info, dict):
        if "redis_version" in info:
            return str(info["redis_version"])
        return ", ".join(sorted({server_version(part) for part in info.values()}))
    for line in text(info).splitlines():
        if line.startswith("redis_version:"):
            return line.partition(":")[2].strip()
    return "unknown version"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
