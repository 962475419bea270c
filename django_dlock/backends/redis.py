"""The Redis backend: one round trip per operation, fenced, woken on release.

Settings::

    "BACKEND": "django_dlock.backends.redis.RedisBackend",
    "LOCATION": "redis://:password@127.0.0.1:6379/0",   # or rediss://, unix://
    "OPTIONS": {"fair": True},

``LOCATION`` may instead be a list of URLs of independent masters: Redlock
(see ``docs/backends/redis.md`` for what that does and does not guarantee).
``OPTIONS``:

- ``fair``: serve waiters first come, first served (default False).
- ``cluster``: ``LOCATION`` is a node of a Redis Cluster (default False).
- ``connection``: ``"django-redis:<cache alias>"`` reuses that cache's
  connection pool instead of ``LOCATION``.
- ``shards``: how many hash slots the index is spread over (default 1; 16
  with ``cluster``).
- ``socket_timeout``, ``socket_connect_timeout``: seconds (default 5 and 2).
- ``client_kwargs``: more keyword arguments for the redis-py client (TLS
  files, ``username``, ``password``, ...).

Key layout, for ``KEY_PREFIX`` P, shard s (``crc32(name) % shards``) and lock
name N. Every key of a shard carries the hash tag ``{Pdlock:s}``, so a lock's
keys always share one Redis Cluster slot::

    {Pdlock:s}:lock:N     string  "owner:token:acquired_us:holder JSON"; SET NX PX: the lease
    {Pdlock:s}:fence      hash    N -> last fencing token issued (never expires)
    {Pdlock:s}:idx        zset    N with score 0: the index that list() reads by prefix
    {Pdlock:s}:waiting:N  string  set by a refused attempt: someone waits (not fair)
    {Pdlock:s}:wake:N     list    a release pushes one element: wakes one waiter (not fair)
    {Pdlock:s}:q:N        list    queued waiters' owner tokens in arrival order
    {Pdlock:s}:qt:N       zset    queued waiter -> deadline in ms by the server clock
    {Pdlock:s}:qi:N       hash    queued waiter -> "ttl_ms:holder JSON", for the hand-over
    {Pdlock:s}:sig:W      list    where queued waiter W learns it was handed the lock
    {Pdlock:s}:done:O:n   string  set for a few seconds when owner O's release request n
                                  ran, so a resent RELEASE answers as the first did
    {Pdlock:s}:done:break:R       the same for BREAK request R (a random id)

Waiters queue from their first refusal with ``fair``, and otherwise once they
have waited STARVE_AFTER; see ``docs/backends/redis.md``.

So ``redis-cli GET '{dlock:0}:lock:report:daily'`` shows who holds
``report:daily`` with which token, and ``redis-cli PTTL`` for how much longer.

Fencing tokens are ``max(previous + 1, server clock in microseconds)``, so a
Redis restarted without its data (or with an older snapshot) still issues
tokens larger than any it issued before, as long as fewer than one token per
microsecond was issued for a name on average.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import secrets
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from django.core import checks

from .._validation import load_holders
from ..exceptions import BackendUnavailable, LockConfigurationError
from .base import BaseLockBackend, Grant, LockInfo

try:
    import redis
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.commands.core import Script
    from redis.exceptions import (
        AuthenticationError,
        AuthenticationWrongNumberOfArgsError,
        AuthorizationError,
        BusyLoadingError,
        ClusterDownError,
        NoPermissionError,
        NoScriptError,
        RedisError,
        ResponseError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "The Redis lock backend needs redis-py: pip install 'django-dlock[redis]'"
    ) from e

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

#: Longest single blocking wait; waiters re-check at least this often.
WAIT_CAP = 1.0
#: A fair waiter that has not re-checked for this long is presumed dead and
#: dropped from the queue; an unfair waiter's "someone waits" flag lasts as
#: long. Must exceed WAIT_CAP comfortably.
WAITER_LEASE_MS = 3000
#: A queued waiter handed the lock gets min(its TTL, this) until its watchdog
#: extends the lease (at a third of it). A waiter stopped (SIGSTOP, a VM
#: pause) just as it is handed the lock holds everyone else up this long; not
#: above WAIT_CAP, so that every waiter behind it has re-checked by then and
#: wakes when it ends (issue 16: 3 s, the waiter lease, before).
HANDOVER_LEASE_MS = 1000
#: Redlock: a master with calls out that has answered none for this long gets
#: no new ones until they return (they end by the socket timeout at the latest).
STUCK_AFTER = 0.5
#: Redlock: threads per master for calling the masters at once.
POOL_PER_MASTER = 4
#: How long a wake-up element survives if nobody pops it.
SIGNAL_TTL_MS = 2000
#: Without ``fair``, a waiter that has waited this long joins the queue, and
#: from then on nobody may barge ahead of it (Go's sync.Mutex starvation mode).
STARVE_AFTER = 0.1

# Shared by the scripts below: the server clock in microseconds.
_NOW_US = """
local now_t = redis.call('time')
local now_us = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])
"""

# Every lock script but EXTEND and LIST shares one layout:
# KEYS[1] lock, KEYS[2] fence hash, KEYS[3] index zset, KEYS[4] queue list
# (waiter ids in arrival order), KEYS[5] queue deadlines zset (waiter -> ms by
# the server clock), KEYS[6] queue info hash (waiter -> "ttl_ms:holder JSON"),
# KEYS[7] "someone waits" flag, KEYS[8] wake list
# ARGV[1] owner token (also the waiter id), ARGV[2] ttl ms, ARGV[3] lock name,
# ARGV[4] holder JSON, ARGV[5] waiter lease ms, ARGV[6] signal key prefix,
# ARGV[7] "1" to join the queue when refused (fair mode, or a waiter that has
# waited too long in unfair mode)
#
# The queue gives first come, first served: while it has a live waiter,
# nobody else may take the lock, and a release hands the lock straight to the
# first live waiter, so it is never idle between holders; so does a refused
# attempt that finds the lock free (a lease ran out) and another waiter first
# in line. The waiter is granted min(its ttl, HANDOVER_LEASE_MS), which bounds
# the stall if it died or stopped in the last moments before its turn, and its
# watchdog extends that to its full TTL. The grant is announced on the
# waiter's signal list as "token:granted_us:lease_ms". Without the queue (the
# unfair fast path) a
# refused caller sets the "someone waits" flag and a release pushes one
# element to the wake list for a blocked waiter to take.

# Grant the lock to `owner`: advance the fencing counter (the token is
# max(last + 1, server clock in us)), write "owner:token:acquired_us:holder"
# with SET NX PX, and index the name. Needs now_us; callers know the lock is free.
_GRANT = """
local function grant(owner, ttl_ms, holder)
    local token = math.max(tonumber(redis.call('hget', KEYS[2], ARGV[3]) or 0) + 1, now_us)
    local token_s = string.format('%d', token)
    local value = owner .. ':' .. token_s .. ':' .. string.format('%d', now_us) .. ':' .. holder
    redis.call('set', KEYS[1], value, 'NX', 'PX', ttl_ms)
    redis.call('hset', KEYS[2], ARGV[3], token_s)
    redis.call('zadd', KEYS[3], 0, ARGV[3])
    return token
end
"""

# The queue's machinery, defined only on the paths that need it (defining Lua
# functions costs on every call). Needs now_us and grant().
_QUEUE_FNS = """
local function live_head()
    local now_ms = math.floor(now_us / 1000)
    while true do
        local head = redis.call('lindex', KEYS[4], 0)
        if not head then return false end
        local deadline = redis.call('zscore', KEYS[5], head)
        if deadline and tonumber(deadline) > now_ms then return head end
        redis.call('lpop', KEYS[4])
        redis.call('zrem', KEYS[5], head)
        redis.call('hdel', KEYS[6], head)
    end
end

local function hand_off()
    while true do
        local head = live_head()
        if not head then return false end
        redis.call('lpop', KEYS[4])
        redis.call('zrem', KEYS[5], head)
        local info = redis.call('hget', KEYS[6], head)
        redis.call('hdel', KEYS[6], head)
        if info then
            local sep = string.find(info, ':', 1, true)
            local lease = math.min(tonumber(string.sub(info, 1, sep - 1)), HANDOVER_LEASE_MS)
            local token = grant(head, lease, string.sub(info, sep + 1))
            local sig = ARGV[6] .. head
            redis.call('rpush', sig, string.format('%d', token) .. ':' ..
                string.format('%d', now_us) .. ':' .. lease)
            redis.call('pexpire', sig, SIGNAL_TTL_MS)
            return true
        end
    end
end

local function enqueue()
    local lease = tonumber(ARGV[5])
    if redis.call('zadd', KEYS[5], math.floor(now_us / 1000) + lease, ARGV[1]) == 1 then
        redis.call('rpush', KEYS[4], ARGV[1])
        redis.call('hset', KEYS[6], ARGV[1], ARGV[2] .. ':' .. ARGV[4])
    end
    for i = 4, 6 do redis.call('pexpire', KEYS[i], 2 * lease) end
end
""".replace("SIGNAL_TTL_MS", str(SIGNAL_TTL_MS)).replace(
    "HANDOVER_LEASE_MS", str(HANDOVER_LEASE_MS)
)

_QUEUE = _NOW_US + _GRANT + _QUEUE_FNS

# Shared: a wake-up for an unfair waiter, if one flagged that it waits.
_WAKE_ONE = """
if redis.call('exists', KEYS[7]) == 1 then
    if redis.call('llen', KEYS[8]) == 0 then redis.call('rpush', KEYS[8], 1) end
    redis.call('pexpire', KEYS[8], SIGNAL_TTL_MS)
end
""".replace("SIGNAL_TTL_MS", str(SIGNAL_TTL_MS))

# Acquire: one attempt, one round trip.
# The lock's value becomes "owner:token:acquired_us:holder JSON"; the token is
# computed first and the counter advanced only if the lock is granted.
# Returns the new fencing token (> 0); {token, PTTL} if ARGV[1] holds the lock
# already (a retry after a lost reply, or a hand-over it has not seen yet);
# when refused, -(holder's PTTL + 1), or {-(PTTL + 1), server time in us} if
# the caller is (now) queued. A lock that is free while another live waiter
# is first in line (a lease ran out: nobody released it) is handed to that
# waiter here, so the queue moves on although the waiter due may be stopped.
ACQUIRE = (
    """
local current = redis.call('get', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
    return {tonumber(string.match(current, '^[^:]*:(%d+):')), redis.call('pttl', KEYS[1])}
end
"""
    + _NOW_US
    + _GRANT
    + """
if not current and redis.call('exists', KEYS[4]) == 0 then
    return grant(ARGV[1], ARGV[2], ARGV[4])  -- nobody queued: the fast path
end
"""
    + _QUEUE_FNS
    + """
local head = live_head()
local pttl = redis.call('pttl', KEYS[1])
if pttl == -2 and (not head or head == ARGV[1]) then
    if head then
        redis.call('lpop', KEYS[4])
        redis.call('zrem', KEYS[5], ARGV[1])
        redis.call('hdel', KEYS[6], ARGV[1])
    end
    return grant(ARGV[1], ARGV[2], ARGV[4])
end
if pttl == -2 and hand_off() then
    pttl = redis.call('pttl', KEYS[1])
end
if ARGV[7] == '1' then
    enqueue()
    return {-(math.max(pttl, 0) + 1), string.format('%d', now_us)}
end
redis.call('set', KEYS[7], 1, 'PX', ARGV[5])
return -(math.max(pttl, 0) + 1)
"""
)

# Shared: is ARGV[1] the owner recorded at the start of the lock's value?
_OWNED = """
local value = redis.call('get', KEYS[1])
if not value or string.sub(value, 1, #ARGV[1] + 1) ~= ARGV[1] .. ':' then return 0 end
"""

# Shared: the lock has just been freed; hand it to the first live queued
# waiter, or else wake an unfair waiter. Returns 1.
_PASS_ON = (
    """
if redis.call('exists', KEYS[4]) == 1 then
"""
    + _QUEUE
    + """
    if hand_off() then return 1 end
end
"""
    + _WAKE_ONE
    + """
return 1
"""
)

# Retries (a socket timeout, a connection lost after the command was sent; our
# client resends once, a Cluster or django-redis client by its own policy) may
# run a script twice. RELEASE and BREAK change what the next run sees, so a
# successful run leaves a short-lived marker that makes the repeat answer as
# the first did: t0 RELEASE runs, t1 its reply is lost, t2 the resent RELEASE
# finds the lock no longer ours but the marker there, and answers 1 instead of
# reporting the lease lost (or, in fair mode, BREAK breaking the waiter it had
# just handed the lock to).

# Release: compare the owner, delete, drop the index entry, pass the lock on.
# KEYS[9] this release request's marker; ARGV[8] the marker's lifetime in ms
# Returns 1 if ARGV[1] held the lock (or an earlier run released it), else 0.
RELEASE = (
    """
local value = redis.call('get', KEYS[1])
if not value or string.sub(value, 1, #ARGV[1] + 1) ~= ARGV[1] .. ':' then
    return redis.call('exists', KEYS[9])
end
redis.call('del', KEYS[1])
redis.call('zrem', KEYS[3], ARGV[3])
redis.call('set', KEYS[9], 1, 'PX', ARGV[8])
"""
    + _PASS_ON
)

# Break: delete whoever holds it and pass the lock on as RELEASE does.
# ARGV[8] "" breaks any holder; a fencing token breaks only the lease with
# that token, or with ARGV[9] = "le" (Redlock, where each master numbers a
# lease on its own and the caller knows the largest) one numbered no higher.
# KEYS[9] the marker of this break request (a random id); ARGV[10] its
# lifetime in ms.
# Returns 1 if a lease was deleted (by this or an earlier run), else 0.
BREAK = (
    """
if redis.call('exists', KEYS[9]) == 1 then return 1 end
local value = redis.call('get', KEYS[1])
if not value then
    redis.call('zrem', KEYS[3], ARGV[3])
    return 0
end
if ARGV[8] ~= '' then
    local token = tonumber(string.match(value, '^[^:]*:(%d+):'))
    local wanted = tonumber(ARGV[8])
    if token ~= wanted and not (ARGV[9] == 'le' and token < wanted) then return 0 end
end
redis.call('del', KEYS[1])
redis.call('zrem', KEYS[3], ARGV[3])
redis.call('set', KEYS[9], 1, 'PX', ARGV[10])
"""
    + _PASS_ON
)

# Abandon: a queued waiter gives up. If it was handed the lock meanwhile, it
# releases it; it leaves the queue; and if the lock is free the turn passes
# on, so the queue does not stall. KEYS[9] is the waiter's signal list.
# Returns 1 if the waiter had been handed the lock, else 0.
ABANDON = (
    _QUEUE
    + """
local granted = 0
local value = redis.call('get', KEYS[1])
if value and string.sub(value, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
    redis.call('del', KEYS[1])
    redis.call('zrem', KEYS[3], ARGV[3])
    granted = 1
end
redis.call('lrem', KEYS[4], 0, ARGV[1])
redis.call('zrem', KEYS[5], ARGV[1])
redis.call('hdel', KEYS[6], ARGV[1])
redis.call('del', KEYS[9])
if redis.call('exists', KEYS[1]) == 0 and not hand_off() then
"""
    + _WAKE_ONE
    + """
end
return granted
"""
)

# Extend: compare the owner, then the lease runs ARGV[2] ms from now.
# KEYS[1] lock; ARGV[1] owner token, ARGV[2] ttl ms
# Returns 1 if ARGV[1] held the lock, else 0.
EXTEND = (
    _OWNED
    + """
redis.call('pexpire', KEYS[1], ARGV[2])
return 1
"""
)

# Adopt: move a handed-over lease from the ticket's owner to the adopter,
# keeping its token, and make it run ARGV[3] ms from now. Once moved, the
# ticket's owner no longer matches, so a second adoption is refused; a
# retry by the same adopter (its reply was lost) finds the lease its own.
# KEYS[1] lock; ARGV[1] owner in the ticket, ARGV[2] adopter's owner token,
# ARGV[3] ttl ms
# Returns 1 if the lease is now ARGV[2]'s, else 0.
ADOPT = """
local value = redis.call('get', KEYS[1])
if not value then return 0 end
if string.sub(value, 1, #ARGV[2] + 1) == ARGV[2] .. ':' then
    redis.call('pexpire', KEYS[1], ARGV[3])
    return 1
end
if string.sub(value, 1, #ARGV[1] + 1) ~= ARGV[1] .. ':' then return 0 end
redis.call('set', KEYS[1], ARGV[2] .. string.sub(value, #ARGV[1] + 1), 'PX', ARGV[3])
return 1
"""

# List one page of one shard: up to ARGV[4] index entries in a lexicographic
# range whose lock is still live, dropping entries whose lease expired. The
# lock keys are built from ARGV[3]; they carry the shard's hash tag, so they
# are in this slot. Pages keep each call short: a script blocks the server.
# KEYS[1] index zset; ARGV[1], ARGV[2] the ZRANGEBYLEX bounds, ARGV[3] the
# lock key prefix "{tag}:lock:", ARGV[4] the page size
# Returns {now_us, next, name1, value1, pttl1, name2, ...}, where next is the
# lower bound of the next page ("(" .. last name), or "" after the last page.
LIST = (
    _NOW_US
    + """
local page = redis.call('zrangebylex', KEYS[1], ARGV[1], ARGV[2], 'LIMIT', 0, tonumber(ARGV[4]))
local out = {string.format('%d', now_us), ''}
if #page == tonumber(ARGV[4]) then out[2] = '(' .. page[#page] end
for _, name in ipairs(page) do
    local key = ARGV[3] .. name
    local value = redis.call('get', key)
    if not value then
        redis.call('zrem', KEYS[1], name)
    else
        -- 0: under a millisecond left, but live (acquire still refuses).
        local pttl = redis.call('pttl', key)
        if pttl >= 0 then
            out[#out + 1] = name
            out[#out + 1] = value
            out[#out + 1] = pttl
        end
    end
end
return out
"""
)

#: Index entries a LIST call reads: about 10 ms of the server's time.
LIST_PAGE = 5000


@dataclass
class _Waiter:
    """What one acquire call has learned while refused; a thread has one at a time."""

    owner: str
    #: When it was first refused, by our clock (unfair waiters queue after STARVE_AFTER).
    since: float
    #: The holder's lease left at the latest refusal, in ms (0: unknown).
    holder_pttl_ms: int = 0
    #: Once queued: (our clock when that attempt was sent, server clock in us).
    queued_at: tuple[float, int] | None = None
    #: A lease the previous holder handed over, seen by wait().
    handed: Grant | None = None


@dataclass(frozen=True)
class _Keys:
    lock: str
    fence: str
    index: str
    wake: str
    waiting: str
    queue: str
    queue_deadlines: str
    queue_info: str
    signal_prefix: str
    done_prefix: str


def _redacted(location: str) -> str:
    """``location`` without its password (in the netloc or the query), for messages."""
    parts = urlsplit(location)
    if parts.password is not None:
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "password" for key, _ in pairs):
        hidden = [(key, "***" if key == "password" else value) for key, value in pairs]
        parts = parts._replace(query=urlencode(hidden, safe="*"))
    if parts.scheme and "://" not in location:
        return location  # "django-redis:<alias>": no URL, no password
    query = f"?{parts.query}" if parts.query else ""
    return f"{parts.scheme}://{parts.netloc}{parts.path}{query}"


def _server_version(info: Any) -> str:
    """``redis_version`` from an INFO reply.

    The reply is raw text from our own connection, or redis-py's parsed dict
    (a cluster client's is keyed by node).
    """
    if isinstance(info, dict):
        if "redis_version" in info:
            return str(info["redis_version"])
        return ", ".join(sorted({_server_version(part) for part in info.values()}))
    for line in _text(info).splitlines():
        if line.startswith("redis_version:"):
            return line.partition(":")[2].strip()
    return "unknown version"


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _lex_range(prefix: str) -> tuple[str, str]:
    if not prefix:
        return "-", "+"
    # Names are UTF-8, which never contains byte 0xFF: every name starting
    # with the prefix sorts below prefix + 0xFF.
    return "[" + prefix, "(" + prefix + "\udcff"


class _Node:
    """One Redis deployment (a server, or a cluster), its scripts and its connections.

    The hot commands (acquire, release, extend, check, a waiter's BLPOP) skip redis-py's
    per-command client machinery (retry wrapper, timing, metrics), which costs
    more than the round trip on loopback: they are written to a connection
    directly with redis-py's own Connection and parser. Our own clients give
    each thread a dedicated connection; a django-redis client's connections
    are borrowed from, and returned to, its pool. A Cluster client keeps
    redis-py's path, which routes each command to its slot's master.
    """

    def __init__(self, client: Any, label: str, *, dedicated: bool, retries: int) -> None:
        self.client = client
        self.label = label
        self.direct = isinstance(client, redis.Redis)
        self.dedicated = dedicated
        self.retries = retries
        self._local = threading.local()
        #: Redlock: calls out and not returned, and when a call last started
        #: with none out or returned (however: an error counts).
        self.outstanding = 0
        self.progress = time.monotonic()
        self._count = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        #: Redlock: per lock name, the last call submitted and not yet done.
        self._tails: dict[str, Future[Any]] = {}
        self._order = threading.Lock()
        self.acquire = Script(client, ACQUIRE)
        self.release = Script(client, RELEASE)
        self.extend = Script(client, EXTEND)
        self.adopt = Script(client, ADOPT)
        self.break_ = Script(client, BREAK)
        self.abandon = Script(client, ABANDON)
        self.list = Script(client, LIST)

    @property
    def pool(self) -> ThreadPoolExecutor:
        """Redlock: this master's threads, so that one that hangs ties up only its own."""
        pool = self._pool
        if pool is None:
            with self._count:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        max_workers=POOL_PER_MASTER, thread_name_prefix="django-dlock-redlock"
                    )
                pool = self._pool
        return pool

    def call(self, call: Callable[[_Node], Any]) -> Any:
        """``call(self)`` on one of this master's pool threads, counted while it is out."""
        with self._count:
            if not self.outstanding:
                self.progress = time.monotonic()
            self.outstanding += 1
        try:
            return call(self)
        finally:
            with self._count:
                self.outstanding -= 1
                self.progress = time.monotonic()

    def submit(self, name: str, call: Callable[[_Node], Any]) -> Future[Any]:
        """Redlock: ``call(self)`` on this master's pool, after its calls for ``name``.

        The pool's threads have a connection each, so two calls for one lock
        could reach the master in either order: an attempt's undo, sent once
        the other masters had decided it, could run before the grant it undoes
        and leave a key nobody holds. A call for a name with one still out is
        submitted when that one is done (an error or timeout counts), without
        tying up a thread while it waits.
        """
        with self._order:
            previous = self._tails.get(name)
            if previous is None or previous.done():
                future = self.pool.submit(self.call, call)
            else:
                future = Future()
                previous.add_done_callback(lambda _: self._relay(call, future))
            self._tails[name] = future
        future.add_done_callback(lambda done: self._forget(name, done))
        return future

    def _relay(self, call: Callable[[_Node], Any], future: Future[Any]) -> None:
        try:
            inner = self.pool.submit(self.call, call)
        except RuntimeError as e:  # the pool was shut down (close())
            future.set_exception(e)
            return

        def copy(done: Future[Any]) -> None:
            error = done.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result())

        inner.add_done_callback(copy)

    def _forget(self, name: str, future: Future[Any]) -> None:
        with self._order:
            if self._tails.get(name) is future:
                del self._tails[name]

    def stuck(self) -> bool:
        """Calls are out and none has returned for STUCK_AFTER seconds."""
        return bool(self.outstanding) and time.monotonic() - self.progress > STUCK_AFTER

    def run(self, script: Script, keys: list[Any], args: list[Any]) -> Any:
        if not self.direct:
            return script(keys=keys, args=args)
        try:
            return self.command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            # The server lost its script cache (a restart, SCRIPT FLUSH).
            script.sha = _text(self.command("SCRIPT", "LOAD", script.script))
            return self.command("EVALSHA", script.sha, len(keys), *keys, *args)

    def _checkout(self) -> Any:
        pool = self.client.connection_pool
        if not self.dedicated:
            return pool.get_connection()
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is None or local.pid != os.getpid():
            conn = local.conn = pool.connection_class(**pool.connection_kwargs)
            local.pid = os.getpid()
        return conn

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
                    conn.send_command(*args)
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

    def pages(self, script: Script, keys: list[Any], args: list[Any]) -> Iterator[Any]:
        """Replies of ``script`` run page after page, as LIST pages.

        ``args[0]`` is where a page starts and ``reply[1]`` where the next
        one does (empty after the last). On our own connections the next
        page's call is sent before this page's reply is handed over, so the
        server runs it while the caller parses this one.
        """
        reply = self.run(script, keys, args)
        if not self.direct:
            yield reply
            while reply[1]:
                reply = self.run(script, keys, [reply[1], *args[1:]])
                yield reply
            return
        conn = self._checkout()
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
                    reply = self.run(script, keys, [reply[1], *args[1:]])
            yield reply
        except BaseException:
            conn.disconnect()
            raise
        finally:
            if sent:
                conn.disconnect()  # the caller stopped early: a reply is on its way
            self._checkin(conn)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.disconnect()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class RedisBackend(BaseLockBackend):
    """Leases in Redis; see the module docstring for the key layout and scripts."""

    wakes_waiters = True
    supports_fair = True
    allowed_options = frozenset(
        {
            "fair",
            "cluster",
            "connection",
            "shards",
            "socket_timeout",
            "socket_connect_timeout",
            "client_kwargs",
        }
    )

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        if "{" in self.key_prefix or "}" in self.key_prefix:
            raise LockConfigurationError(
                f"Lock backend {alias!r}: KEY_PREFIX must not contain braces; they would "
                "change the keys' Redis Cluster hash tag.",
                alias=alias,
            )
        options = self.options
        self.fair = self._bool_option("fair")
        self.cluster = self._bool_option("cluster")
        self.connection_spec = options.get("connection")
        self.socket_timeout = self._number_option("socket_timeout", 5.0)
        self.socket_connect_timeout = self._number_option("socket_connect_timeout", 2.0)
        self.client_kwargs = options.get("client_kwargs") or {}
        if not isinstance(self.client_kwargs, Mapping):
            raise LockConfigurationError(
                f"Lock backend {alias!r}: OPTIONS['client_kwargs'] must be a dict.", alias=alias
            )
        locations = self._locations()
        self.redlock = len(locations) > 1
        if self.redlock and (self.fair or self.cluster):
            raise LockConfigurationError(
                f"Lock backend {alias!r}: a list of LOCATIONs is Redlock over independent "
                "masters; it cannot be combined with 'fair' or 'cluster'.",
                alias=alias,
            )
        self.locations = locations
        self.quorum = len(locations) // 2 + 1
        shards = options.get("shards", 16 if self.cluster else 1)
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise LockConfigurationError(
                f"Lock backend {alias!r}: OPTIONS['shards'] must be a positive int.", alias=alias
            )
        self.shards = shards
        self._blocking_cap = min(WAIT_CAP, self.socket_timeout * 0.8)
        # How long a RELEASE or BREAK marker lives: long enough for any resend
        # of that command (each try waits at most socket_timeout).
        self._done_ms = _ms(max(1.0, 2 * self.socket_timeout))
        self._requests = itertools.count()
        self._nodes: list[_Node] | None = None
        self._mutex = threading.Lock()
        # The refused attempt's state, per thread and per asyncio task.
        self._waiter_var: ContextVar[_Waiter | None] = ContextVar(
            f"django-dlock-waiter-{alias}", default=None
        )
        # A single server needs no routing or quorum: the awaitable primitives
        # use redis.asyncio there, one client per event loop.
        self.native_async = not (self.redlock or self.cluster or self.connection_spec)
        self._aclients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._tags = [f"{{{self.key_prefix}dlock:{s}}}" for s in range(shards)]
        _backends.add(self)
        # Building eight key strings per call shows in the uncontended cycle.
        self._keys = functools.lru_cache(maxsize=4096)(self._make_keys)

    # --- configuration ----------------------------------------------------------------

    def _locations(self) -> list[str]:
        location = self.location
        if self.connection_spec is not None:
            spec = self.connection_spec
            if not (isinstance(spec, str) and spec.startswith("django-redis:") and spec[13:]):
                raise LockConfigurationError(
                    f"Lock backend {self.alias!r}: OPTIONS['connection'] must look like "
                    "'django-redis:<cache alias>'.",
                    alias=self.alias,
                )
            if location is not None:
                raise LockConfigurationError(
                    f"Lock backend {self.alias!r}: give either LOCATION or "
                    "OPTIONS['connection'], not both.",
                    alias=self.alias,
                )
            return [spec]
        if isinstance(location, str):
            locations = [location]
        elif isinstance(location, Sequence) and location and not isinstance(location, bytes):
            locations = list(location)
        else:
            raise LockConfigurationError(
                f"Lock backend {self.alias!r}: LOCATION must be a redis:// URL or a list of "
                "them (Redlock).",
                alias=self.alias,
            )
        for url in locations:
            if not isinstance(url, str) or url.split("://", 1)[0] not in (
                "redis",
                "rediss",
                "unix",
            ):
                raise LockConfigurationError(
                    f"Lock backend {self.alias!r}: {url!r} is not a redis://, rediss:// or "
                    "unix:// URL.",
                    alias=self.alias,
                )
        return locations

    def drift(self, ttl: float) -> float:
        """Redlock: the masters' clocks may drift; count on 1 % less, minus 2 ms."""
        return ttl * 0.01 + 0.002 if self.redlock else 0.0

    def check(self) -> list[checks.CheckMessage]:
        if self.redlock and len(self.locations) % 2 == 0:
            return [
                checks.Warning(
                    f"Lock backend {self.alias!r}: Redlock over an even number of masters "
                    f"({len(self.locations)}) tolerates no more failures than one fewer.",
                    id="django_dlock.W001",
                )
            ]
        return []

    # --- connections ------------------------------------------------------------------

    def _client_for(self, location: str) -> Any:
        if location.startswith("django-redis:"):
            from django_redis import get_redis_connection

            client = get_redis_connection(location[13:])
            pool_timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
            if pool_timeout:
                # A blocking wait must end before that pool's socket gives up.
                self._blocking_cap = min(self._blocking_cap, pool_timeout * 0.8)
            return client
        kwargs = self._client_kwargs(Retry)
        if self.cluster:
            return RedisCluster.from_url(location, **kwargs)
        return redis.Redis.from_url(location, **kwargs)

    def _client_kwargs(self, retry_class: Any) -> dict[str, Any]:
        """redis-py client arguments, for the sync clients and the asyncio one."""
        kwargs: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_connect_timeout,
            "health_check_interval": 30,
            # A Redlock master that is down must cost one refused connection,
            # not retries; a single server gets one retry (scripts are idempotent).
            "retry": retry_class(NoBackoff(), 0 if self.redlock else 1),
        }
        kwargs.update(self.client_kwargs)
        return kwargs

    @property
    def nodes(self) -> list[_Node]:
        nodes = self._nodes
        if nodes is None:
            with self._mutex:
                if self._nodes is None:
                    self._nodes = [
                        _Node(
                            self._client_for(location),
                            _redacted(location),
                            dedicated=not location.startswith("django-redis:"),
                            retries=0 if self.redlock else 1,
                        )
                        for location in self.locations
                    ]
                nodes = self._nodes
        return nodes

    def close(self) -> None:
        with self._mutex:
            nodes, self._nodes = self._nodes, None
        for node in nodes or ():
            node.close()
            if not node.label.startswith("django-redis:"):
                node.client.close()

    def _unavailable(self, name: str, error: Exception, node: _Node) -> BackendUnavailable:
        what = f" for lock {name!r}" if name else ""
        return BackendUnavailable(
            f"Redis at {node.label} failed{what} on backend {self.alias!r}: {error}",
            name=name,
            backend=self.alias,
            # NOAUTH, WRONGPASS, NOPERM: only new settings (or ACLs) fix these.
            # Only a server that did not answer, or is loading or failing
            # over, is worth waiting for; a script error (a TTL out of range,
            # a key of the wrong type) or a refused login fails every time.
            transient=isinstance(error, _TRANSIENT) and not isinstance(error, _REFUSED_WHO),
        )

    # --- keys -------------------------------------------------------------------------

    def _make_keys(self, name: str) -> _Keys:
        tag = self._tags[zlib.crc32(name.encode()) % self.shards if self.shards > 1 else 0]
        return _Keys(
            lock=f"{tag}:lock:{name}",
            fence=f"{tag}:fence",
            index=f"{tag}:idx",
            wake=f"{tag}:wake:{name}",
            waiting=f"{tag}:waiting:{name}",
            queue=f"{tag}:q:{name}",
            queue_deadlines=f"{tag}:qt:{name}",
            queue_info=f"{tag}:qi:{name}",
            signal_prefix=f"{tag}:sig:",
            done_prefix=f"{tag}:done:",
        )

    # --- running a script on one node or a quorum -------------------------------------

    def _on_each(
        self, name: str, call: Any, decided: Callable[[list[Any]], bool] | None = None
    ) -> list[Any]:
        """Run ``call(node)`` on every node; an exception is recorded as the result.

        Redlock calls its masters at once, each on a thread of its own pool,
        and returns as soon as ``decided(results)`` says the answers in hand
        settle the outcome (results not in yet stay ``_PENDING``), or when
        ``socket_timeout`` has passed: a master that accepts and never
        answers costs one timeout, not one per master per call. A master with
        a call still out past such a deadline is not sent another until it
        answers (it counts as unavailable) once it has answered nothing for
        STUCK_AFTER seconds, so it cannot tie up the pool.
        """
        nodes = self.nodes
        if len(nodes) == 1:
            try:
                return [call(nodes[0])]
            except RedisError as e:
                return [self._unavailable(name, e, nodes[0])]
        results: list[Any] = [_PENDING] * len(nodes)
        futures: dict[Future[Any], int] = {}
        for i, node in enumerate(nodes):
            if node.stuck():
                results[i] = self._unavailable(name, _Stuck(node.label), node)
                continue
            futures[node.submit(name, call)] = i
        pending = set(futures)
        deadline = time.monotonic() + self.socket_timeout
        while pending and not (decided is not None and decided(results)):
            done, pending = wait(
                pending, timeout=max(deadline - time.monotonic(), 0), return_when=FIRST_COMPLETED
            )
            if not done:
                break
            for future in done:
                i = futures[future]
                try:
                    results[i] = future.result()
                except RedisError as e:
                    results[i] = self._unavailable(name, e, nodes[i])
        if decided is not None and decided(results):
            return results  # the ones still out do not matter: they stay _PENDING
        for i, result in enumerate(results):
            if result is _PENDING:
                results[i] = self._unavailable(name, _Stuck(nodes[i].label), nodes[i])
        return results

    def _single(self, name: str, call: Any) -> Any:
        node = self.nodes[0]
        try:
            return call(node)
        except RedisError as e:
            raise self._unavailable(name, e, node) from e

    def _quorum_bool(self, name: str, call: Any) -> bool:
        if not self.redlock:
            return bool(self._single(name, call))
        results = self._on_each(name, call, self._settled(lambda r: bool(r)))
        errors = [r for r in results if isinstance(r, BackendUnavailable)]
        if len(errors) > len(results) - self.quorum:
            raise errors[0]
        return sum(1 for r in results if _answer(r) and r) >= self.quorum

    def _settled(self, success: Callable[[Any], bool]) -> Callable[[list[Any]], bool]:
        """``decided`` for _on_each: a quorum succeeded, or too many cannot."""
        quorum, count = self.quorum, len(self.locations)

        def decided(results: list[Any]) -> bool:
            answered = [r for r in results if r is not _PENDING]
            good = sum(1 for r in answered if _answer(r) and success(r))
            return good >= quorum or len(answered) - good > count - quorum

        return decided

    # --- primitives -------------------------------------------------------------------

    def _lock_keys(self, k: _Keys) -> list[str]:
        return [
            k.lock, k.fence, k.index, k.queue, k.queue_deadlines, k.queue_info, k.waiting, k.wake,
        ]  # fmt: skip

    def _waiter(self, owner: str) -> _Waiter | None:
        waiter = self._waiter_var.get()
        return waiter if waiter is not None and waiter.owner == owner else None

    def _acquire_call(self, name: str, owner: str, ttl: float, holder: str) -> Any:
        keys, args = self._acquire_args(name, owner, ttl, holder)
        return lambda node: node.run(node.acquire, keys, args)

    def _acquire_args(
        self, name: str, owner: str, ttl: float, holder: str
    ) -> tuple[list[str], list[Any]]:
        k = self._keys(name)
        args = [owner, _ms(ttl), name, holder, WAITER_LEASE_MS, k.signal_prefix, ""]
        waiter = self._waiter(owner)
        starving = waiter is not None and time.monotonic() - waiter.since >= STARVE_AFTER
        # Never under Redlock: each master would queue and hand over on its
        # own, and a hand-over by one master is not a majority's grant.
        if self.fair or (starving and not self.redlock):
            args[6] = "1"
        return self._lock_keys(k), args

    def _release_call(self, name: str, owner: str) -> Any:
        keys, args = self._release_args(name, owner)
        return lambda node: node.run(node.release, keys, args)

    def _release_args(self, name: str, owner: str) -> tuple[list[str], list[Any]]:
        k = self._keys(name)
        # The marker names this request, so that a resend of it finds it but a
        # second release of the same owner (a ticket released twice) does not.
        keys = [*self._lock_keys(k), f"{k.done_prefix}{owner}:{next(self._requests)}"]
        args = [owner, "", name, "", WAITER_LEASE_MS, k.signal_prefix, "", self._done_ms]
        return keys, args

    def _outcome(self, reply: Any, owner: str, sent: float) -> int | Grant | None:
        """Read an acquire reply; on a refusal, note what wait() needs."""
        if isinstance(reply, list):
            first, second = int(reply[0]), int(reply[1])
            if first > 0:
                # Ours already: the service had PTTL left when it answered,
                # which was no earlier than `sent`.
                return Grant(first, sent + second / 1000, second / 1000)
            pttl_ms, queued_at = -first - 1, (sent, second)
        else:
            result = int(reply)
            if result > 0:
                return result
            pttl_ms, queued_at = -result - 1, None
        waiter = self._waiter(owner)
        if waiter is None:
            waiter = _Waiter(owner, since=sent)
            self._waiter_var.set(waiter)
        waiter.holder_pttl_ms = pttl_ms
        if queued_at is not None:
            waiter.queued_at = queued_at
        return None

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        handed = self._take_handed(owner)
        if handed is not None:
            return handed  # wait() saw the previous holder hand the lock over
        call = self._acquire_call(name, owner, ttl, holder)
        sent = time.monotonic()
        if not self.redlock:
            return self._outcome(self._single(name, call), owner, sent)
        results = self._on_each(name, call, self._settled(_granted))
        errors = [r for r in results if isinstance(r, BackendUnavailable)]
        outcomes = [self._outcome(r, owner, sent) for r in results if _answer(r)]
        granted = [o for o in outcomes if o is not None]
        validity = ttl - (time.monotonic() - sent) - self.drift(ttl)
        if len(granted) >= self.quorum and validity > 0:
            tokens = [o.token if isinstance(o, Grant) else o for o in granted]
            expiries = [o.expires if isinstance(o, Grant) else sent + ttl for o in granted]
            lease = min(o.lease if isinstance(o, Grant) else ttl for o in granted)
            # The lease holds while a majority holds it: until the quorum-th
            # earliest expiry counted from the latest.
            return Grant(max(tokens), sorted(expiries)[-self.quorum], lease)
        # Failed: undo everywhere (compare-and-delete is safe where we did not get it).
        self._on_each(name, self._release_call(name, owner))
        if len(errors) > len(results) - self.quorum:
            raise errors[0]
        refusals = [
            int(r) for r in results if _answer(r) and not isinstance(r, list) and int(r) < 0
        ]
        waiter = self._waiter(owner)
        if waiter is None:
            waiter = _Waiter(owner, since=sent)
            self._waiter_var.set(waiter)
        # Wait on the soonest-expiring refusal.
        waiter.holder_pttl_ms = -max(refusals) - 1 if refusals else 0
        return None

    def do_release(self, name: str, owner: str) -> bool:
        return self._quorum_bool(name, self._release_call(name, owner))

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        k = self._keys(name)
        ttl_ms = _ms(ttl)
        return self._quorum_bool(
            name, lambda node: node.run(node.extend, [k.lock], [owner, ttl_ms])
        )

    def do_adopt(self, name: str, owner: str, new_owner: str, ttl: float, state: Any) -> bool:
        lock_key, ttl_ms = self._keys(name).lock, _ms(ttl)
        return self._quorum_bool(
            name, lambda node: node.run(node.adopt, [lock_key], [owner, new_owner, ttl_ms])
        )

    def do_check(self, name: str, owner: str) -> bool:
        lock_key = self._keys(name).lock
        mine = f"{owner}:".encode()
        return self._quorum_bool(
            name, lambda node: _bytes(node.command("GET", lock_key) or b"").startswith(mine)
        )

    def do_break(self, name: str, token: int | None) -> bool:
        k = self._keys(name)
        # The marker is per request: a retry of this break, not a later one.
        keys = [*self._lock_keys(k), f"{k.done_prefix}break:{secrets.token_hex(8)}"]
        wanted = "" if token is None else str(token)
        compare = "le" if self.redlock else "eq"
        args = [
            "", "", name, "", WAITER_LEASE_MS, k.signal_prefix, "", wanted, compare, self._done_ms,
        ]  # fmt: skip
        if not self.redlock:
            return bool(self._single(name, lambda node: node.run(node.break_, keys, args)))
        if token is not None:
            # The lease numbered `token` is the one whose largest per-master
            # token it is; unless a master still holds that number, it is gone.
            values = self._on_each(name, lambda node: node.command("GET", k.lock))
            if not any(
                _text(v).split(":", 2)[1] == wanted
                for v in values
                if v is not None and not isinstance(v, Exception)
            ):
                return False
        results = self._on_each(name, lambda node: node.run(node.break_, keys, args))
        return any(r == 1 for r in results if not isinstance(r, Exception))

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        versions: set[str] = set()
        warnings = []
        for node in self.nodes:
            try:
                versions.add(_server_version(node.command("INFO", "server")))
            except RedisError as e:
                if not self.redlock:
                    raise self._unavailable("", e, node) from e
                warnings.append(f"Redlock master {node.label} does not answer: {e}")
        if len(versions) == 0 or len(self.nodes) - len(warnings) < self.quorum:
            raise BackendUnavailable(
                f"Fewer than {self.quorum} of {len(self.nodes)} Redlock masters answer on "
                f"backend {self.alias!r}: {'; '.join(warnings)}",
                backend=self.alias,
            )
        return "Redis " + ", ".join(sorted(versions)), tuple(warnings)

    def do_abandon(self, name: str, owner: str) -> None:
        plan = self._abandon_plan(name, owner)
        if plan is not None:
            keys, args = plan
            self._single(name, lambda node: node.run(node.abandon, keys, args))

    def _abandon_plan(self, name: str, owner: str) -> tuple[list[str], list[Any]] | None:
        """The ABANDON call ``do_abandon`` makes, or None if there is nothing to leave."""
        waiter = self._waiter(owner)
        self._waiter_var.set(None)
        if not self.fair and (waiter is None or waiter.queued_at is None):
            return None  # an unfair waiter that never joined the queue: nothing to leave
        k = self._keys(name)
        keys = [*self._lock_keys(k), k.signal_prefix + owner]
        args = [owner, "", name, "", WAITER_LEASE_MS, k.signal_prefix, ""]
        return keys, args

    def do_list(self, prefix: str) -> list[LockInfo]:
        low, high = _lex_range(prefix)
        per_node: list[dict[str, LockInfo]] = []
        for node in self.nodes:
            found: dict[str, LockInfo] = {}
            try:
                for tag in self._tags:
                    args = [
                        low.encode("utf-8", "surrogateescape"),
                        high.encode("utf-8", "surrogateescape"),
                        f"{tag}:lock:",
                        LIST_PAGE,
                    ]
                    for reply in node.pages(node.list, [f"{tag}:idx"], args):
                        found.update(self._parse_list(reply))
            except RedisError as e:
                if not self.redlock:
                    raise self._unavailable(prefix, e, node) from e
                continue
            per_node.append(found)
        if not self.redlock:
            return list(per_node[0].values()) if per_node else []
        return self._merge_quorum(per_node)

    def _parse_list(self, reply: list[Any]) -> dict[str, LockInfo]:
        # Runs for every lease listed (100,000 for manage.py locks --json):
        # positional arguments and the datetime constructor held in locals.
        now_us = int(reply[0])
        values = [_text(value).split(":", 3) for value in reply[3::3]]
        holders, faithful = load_holders([value[3] for value in values])
        alias, stamp, utc = self.alias, datetime.fromtimestamp, timezone.utc
        found = {}
        for name, (_owner, token_s, acquired_s, text), holder, pttl in zip(
            map(_text, reply[2::3]), values, holders, reply[4::3], strict=True
        ):
            pttl_ms = int(pttl)
            found[name] = LockInfo(
                alias,
                name,
                int(token_s),
                holder,
                stamp(int(acquired_s) / 1_000_000, utc),  # micros_to_datetime()
                stamp((now_us + pttl_ms * 1000) / 1_000_000, utc),
                pttl_ms / 1000,
                text if faithful else None,
            )
        return found

    def _merge_quorum(self, per_node: list[dict[str, LockInfo]]) -> list[LockInfo]:
        names: dict[str, list[LockInfo]] = {}
        for found in per_node:
            for name, info in found.items():
                names.setdefault(name, []).append(info)
        merged = []
        for infos in names.values():
            if len(infos) < self.quorum:
                continue
            soonest = min(infos, key=lambda i: i.expires_in)
            merged.append(
                LockInfo(
                    backend=self.alias,
                    name=soonest.name,
                    token=max(i.token for i in infos),
                    holder=soonest.holder,
                    acquired_at=min(i.acquired_at for i in infos),
                    expires_at=soonest.expires_at,
                    expires_in=soonest.expires_in,
                )
            )
        return merged

    def wait(self, name: str, owner: str, remaining: float | None, attempt: int) -> None:
        """Block on the wake-up list until a release, or a fallback re-check.

        The fallback is never longer than half the holder's remaining lease (or
        that lease plus a millisecond when it is short), nor than WAIT_CAP, so a
        lost wake-up or a holder that died cannot strand a waiter. In fair
        mode the wake-up is the hand-over itself: "token:granted_us:lease_ms".
        """
        plan = self._wait_plan(name, owner, remaining)
        if plan is None:
            return
        key, timeout = plan
        for node in self.nodes:
            if node.stuck():
                continue  # Redlock: a master that does not answer would hold us up
            try:
                # On the direct path too: the woken waiter's next step is the
                # critical path of a hand-over.
                popped = node.command("BLPOP", key, round(timeout, 3))
            except RedisError:
                continue  # Redlock: that master is down; block on the next one
            self._woken(owner, popped)
            return
        time.sleep(timeout)

    def _wait_plan(
        self, name: str, owner: str, remaining: float | None
    ) -> tuple[str, float] | None:
        """The list ``wait()`` blocks on and for how long; None: do not block."""
        waiter = self._waiter(owner)
        holder_ms = waiter.holder_pttl_ms if waiter is not None else 0
        fallback = max(holder_ms / 2000, min(holder_ms / 1000 + 0.001, 0.05))
        timeout = min(self._blocking_cap, fallback if holder_ms else WAIT_CAP)
        if remaining is not None:
            timeout = min(timeout, remaining)
        if timeout < 0.001:
            return None
        k = self._keys(name)
        if waiter is not None and waiter.queued_at is not None:
            return k.signal_prefix + owner, timeout
        if waiter is not None and not (self.fair or self.redlock):
            # Wake when this waiter may join the queue, if that comes first;
            # once it has passed, the next attempt queues and no cap applies.
            until_queue = waiter.since + STARVE_AFTER - time.monotonic()
            if until_queue > 0.001:
                timeout = min(timeout, until_queue)
        return k.wake, timeout

    def _take_handed(self, owner: str) -> Grant | None:
        """The lease ``wait()`` saw handed to ``owner``, if most of it is left.

        Its lease counts from when it was handed over, not from now: a
        waiter that was slow to see it (paused, stopped with SIGSTOP) may
        find it gone, or about to go, and handed to the next waiter. Then
        the attempt asks the server instead, which answers with the lease
        left if it is still ours, and queues it again if it is not.
        """
        waiter = self._waiter(owner)
        if waiter is None or waiter.handed is None:
            return None
        handed, waiter.handed = waiter.handed, None
        left = handed.expires - time.monotonic()
        if left <= handed.lease / 2:
            return None
        # The watchdog's first renewal comes at a third of what is left.
        return Grant(handed.token, handed.expires, left)

    def _woken(self, owner: str, popped: Any) -> None:
        """A BLPOP returned: in fair mode, what it popped is the hand-over."""
        waiter = self._waiter(owner)
        if popped and waiter is not None and waiter.queued_at is not None:
            waiter.handed = _handed_over(waiter.queued_at, _text(popped[1]))

    # --- native async (single server) -------------------------------------------------

    def _aclient(self) -> Any:
        """This event loop's redis.asyncio client (clients are bound to their loop)."""
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            client = self._aclients[loop] = redis.asyncio.Redis.from_url(
                self.locations[0], **self._client_kwargs(AsyncRetry)
            )
        return client

    async def _arun(self, name: str, script: Script, keys: list[Any], args: list[Any]) -> Any:
        client = self._aclient()
        try:
            try:
                return await client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                await client.script_load(script.script)
                return await client.evalsha(script.sha, len(keys), *keys, *args)
        except RedisError as e:
            raise self._unavailable(name, e, self.nodes[0]) from e

    async def ado_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        handed = self._take_handed(owner)
        if handed is not None:
            return handed
        keys, args = self._acquire_args(name, owner, ttl, holder)
        sent = time.monotonic()
        reply = await self._arun(name, self.nodes[0].acquire, keys, args)
        return self._outcome(reply, owner, sent)

    async def ado_release(self, name: str, owner: str) -> bool:
        if not self.native_async:
            return await super().ado_release(name, owner)
        keys, args = self._release_args(name, owner)
        return bool(await self._arun(name, self.nodes[0].release, keys, args))

    async def ado_extend(self, name: str, owner: str, ttl: float) -> bool:
        if not self.native_async:
            return await super().ado_extend(name, owner, ttl)
        keys = [self._keys(name).lock]
        return bool(await self._arun(name, self.nodes[0].extend, keys, [owner, _ms(ttl)]))

    async def ado_check(self, name: str, owner: str) -> bool:
        if not self.native_async:
            return await super().ado_check(name, owner)
        try:
            value = await self._aclient().get(self._keys(name).lock)
        except RedisError as e:
            raise self._unavailable(name, e, self.nodes[0]) from e
        return _bytes(value or b"").startswith(f"{owner}:".encode())

    async def ado_abandon(self, name: str, owner: str) -> None:
        plan = self._abandon_plan(name, owner)
        if plan is not None:
            await self._arun(name, self.nodes[0].abandon, *plan)
        return None

    async def await_(self, name: str, owner: str, remaining: float | None, attempt: int) -> None:
        plan = self._wait_plan(name, owner, remaining)
        if plan is None:
            return None
        key, timeout = plan
        try:
            popped = await self._aclient().blpop([key], round(timeout, 3))
        except RedisError as e:
            raise self._unavailable(name, e, self.nodes[0]) from e
        self._woken(owner, popped)
        return None


_PENDING: Any = object()

_backends: weakref.WeakSet[RedisBackend] = weakref.WeakSet()


def _reset_after_fork() -> None:
    # A forked child has none of the parent's threads: Redlock's pools would
    # queue calls nobody runs, and their counters would say a master is stuck.
    # Its nodes (and their connections) are made anew on first use.
    for backend in list(_backends):
        backend._nodes = None


os.register_at_fork(after_in_child=_reset_after_fork)


class _Stuck(RedisError):
    def __init__(self, label: str) -> None:
        super().__init__(f"{label} did not answer in time (a call to it is still out)")


def _answer(result: Any) -> bool:
    """A master's reply in _on_each's results: not an error, not still out."""
    return result is not _PENDING and not isinstance(result, Exception)


def _granted(reply: Any) -> bool:
    """Whether an ACQUIRE reply grants the lock (a token, or {token, pttl})."""
    first = reply[0] if isinstance(reply, list) else reply
    return int(first) > 0


def _handed_over(queued_at: tuple[float, int], signal: str) -> Grant:
    """The lease in a hand-over signal "token:granted_us:lease_ms", on our clock."""
    token, granted_us, lease_ms = (int(part) for part in signal.split(":"))
    sent, server_us = queued_at
    # The refused attempt that queued us was answered at server time server_us,
    # at a moment of ours no earlier than `sent`; the grant came granted_us -
    # server_us later on the server's clock, so no earlier than this:
    granted = sent + (granted_us - server_us) / 1_000_000
    lease = lease_ms / 1000
    return Grant(token, granted + lease, lease)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
