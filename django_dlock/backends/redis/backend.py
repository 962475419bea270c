"""RedisBackend: one server (or a Cluster, or a django-redis pool), one round trip per operation.

The key layout and settings are in the package docstring
(``django_dlock/backends/redis/__init__.py``), the scripts in ``scripts.py``.
"""

from __future__ import annotations

import functools
import itertools
import os
import secrets
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from django.core import checks

from redis import Redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from ...clocks import ms
from ...exceptions import BackendUnavailable, LockConfigurationError
from ..base import BaseLockBackend, Grant, LockInfo
from ..ops import MutexOps
from ..probe import PROBE_NAME
from ..redaction import redacted
from .aio import AsyncNode
from .connections import (
    CLIENT_ERRORS,
    Node,
    as_bytes,
    ask_version,
    text,
    transient,
)
from .listing import get_lease, iter_node
from .native_async import RedisAttempt, RedisNativeAsync
from .options import check_client_kwargs, check_url, tls_file_errors
from .renewals import RedisRenewals
from .scripts import WAITER_LEASE_MS, Keys, lock_key
from .semaphores import RedisParking, RedisSemaphores
from .waiters import handed_over, take_handed

#: Longest single blocking wait; waiters re-check at least this often.
WAIT_CAP = 1.0
#: Without ``fair``, a waiter that has waited this long joins the queue, and
#: from then on nobody may barge ahead of it (Go's sync.Mutex starvation mode).
STARVE_AFTER = 0.1


class RedisLocks(RedisNativeAsync, BaseLockBackend):
    """The mutex core of the Redis backends; see the package docstring for the key layout.

    :class:`RedisBackend` declares it with its parts (semaphores, parked
    tasks, batched renewals); :class:`~.redlock.RedlockBackend`, over
    independent masters, declares it alone.
    """

    supports_wakeups = True
    attempt_class = RedisAttempt
    #: Redlock over independent masters (RedlockBackend)?
    redlock: ClassVar[bool] = False
    #: May a waiter join the lock's queue on the server (``fair``, or an
    #: unfair waiter that has waited STARVE_AFTER)?
    queues_waiters: ClassVar[bool] = True
    #: How often a command is resent after its connection failed.
    retries: ClassVar[int] = 1
    node_class: ClassVar[type[Node]] = Node
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
        # Arrival order only with ``fair``: otherwise a waiter queues only
        # once it has waited STARVE_AFTER, and may be overtaken before that.
        self.supports_fair = self.fair
        self.cluster = self._bool_option("cluster")
        self.connection_spec = options.get("connection")
        self.socket_timeout = self._number_option("socket_timeout", 5.0)
        self.socket_connect_timeout = self._number_option("socket_connect_timeout", 2.0)
        self.native_async = not (self.cluster or self.connection_spec or self.redlock)
        self.locations = self._locations()
        self.client_kwargs = check_client_kwargs(
            alias,
            options.get("client_kwargs") or {},
            {url.partition("://")[0] for url in self.locations if "://" in url},
            cluster=self.cluster,
            native_async=self.native_async,
        )
        shards = options.get("shards", 16 if self.cluster else 1)
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise LockConfigurationError(
                f"Lock backend {alias!r}: OPTIONS['shards'] must be a positive int.", alias=alias
            )
        self.shards = shards
        self._blocking_cap = min(WAIT_CAP, self.socket_timeout * 0.8)
        # How long a RELEASE or BREAK marker lives: long enough for any resend
        # of that command (each try waits at most socket_timeout).
        self._done_ms = ms(max(1.0, 2 * self.socket_timeout))
        self._requests = itertools.count()
        self._nodes: list[Node] | None = None
        self._mutex = threading.Lock()
        self._anode = AsyncNode(self.locations[0], lambda: self._client_kwargs(AsyncRetry))
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
                raise self.config_error(
                    "OPTIONS['connection'] must look like 'django-redis:<cache alias>'."
                )
            if location is not None:
                raise self.config_error("give either LOCATION or OPTIONS['connection'], not both.")
            return [spec]
        if isinstance(location, str):
            locations = [location]
        elif isinstance(location, Sequence) and location and not isinstance(location, bytes):
            locations = list(location)
        else:
            raise self.config_error("LOCATION must be a redis:// URL or a list of them (Redlock).")
        if len(locations) > 1 and not self.redlock:
            raise self.config_error(
                "RedisBackend takes one LOCATION, not a list of several. For Redlock over "
                "independent masters, set BACKEND to "
                "'django_dlock.backends.redis.RedlockBackend' (Django's RedisCache reads "
                "such a list as a primary and its replicas; no lock backend does)."
            )
        for url in locations:
            check_url(self.alias, url, cluster=self.cluster, native_async=self.native_async)
        return locations

    def check(self) -> list[checks.CheckMessage]:
        errors = tls_file_errors(self.alias, self.client_kwargs)
        return [checks.Error(error, id="django_dlock.E006") for error in errors]

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
        return Redis.from_url(location, **kwargs)

    def _client_kwargs(self, retry_class: Any) -> dict[str, Any]:
        """redis-py client arguments, for the sync clients and the asyncio one."""
        kwargs: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_connect_timeout,
            "health_check_interval": 30,
            # A Redlock master that is down must cost one refused connection,
            # not retries; a single server gets one retry (scripts are idempotent).
            "retry": retry_class(NoBackoff(), self.retries),
        }
        kwargs.update(self.client_kwargs)
        return kwargs

    @property
    def nodes(self) -> list[Node]:
        nodes = self._nodes
        if nodes is None:
            with self._mutex:
                if self._nodes is None:
                    self._nodes = [
                        self.node_class(
                            self._connect(location),
                            redacted(location),
                            dedicated=not location.startswith("django-redis:"),
                            retries=self.retries,
                        )
                        for location in self.locations
                    ]
                nodes = self._nodes
        return nodes

    def _connect(self, location: str) -> Any:
        """A client for ``location``; a Cluster's reads its slots from the servers now.

        A cluster that cannot be reached then (the first call during an
        outage, as every forked worker's first call) is ``BackendUnavailable``
        like any outage, and the next call tries again.
        """
        try:
            return self._client_for(location)
        except CLIENT_ERRORS as e:
            raise BackendUnavailable(
                f"Redis at {redacted(location)} failed on backend {self.alias!r}: {e}",
                backend=self.alias,
                transient=transient(e),
            ) from e

    def close(self) -> None:
        with self._mutex:
            nodes, self._nodes = self._nodes, None
        for node in nodes or ():
            node.close()
            if not node.label.startswith("django-redis:"):
                node.client.close()

    def _unavailable(self, name: str, error: BaseException, node: Node) -> BackendUnavailable:
        what = f" for lock {name!r}" if name else ""
        return BackendUnavailable(
            f"Redis at {node.label} failed{what} on backend {self.alias!r}: {error}",
            name=name,
            backend=self.alias,
            transient=transient(error),
        )

    # --- keys -------------------------------------------------------------------------

    def tag(self, name: str) -> str:
        """The hash tag of ``name``'s shard, which all its keys (mutex and semaphore) carry."""
        return self._tags[zlib.crc32(name.encode()) % self.shards if self.shards > 1 else 0]

    def _make_keys(self, name: str) -> Keys:
        tag = self.tag(name)
        return Keys(
            lock=lock_key(tag, name),
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

    def _lock_keys(self, k: Keys) -> list[str]:
        return [
            k.lock, k.fence, k.index, k.queue, k.queue_deadlines, k.queue_info, k.waiting, k.wake,
        ]  # fmt: skip

    # --- running a call on the server: RedlockBackend runs it on a quorum -------------

    def _single(self, name: str, call: Callable[[Node], Any]) -> Any:
        node = self.nodes[0]
        try:
            return call(node)
        except CLIENT_ERRORS as e:
            raise self._unavailable(name, e, node) from e

    def _run_bool(self, name: str, call: Callable[[Node], Any]) -> bool:
        """Whether ``call`` answered true (Redlock: on a majority of masters)."""
        return bool(self._single(name, call))

    # --- primitives -------------------------------------------------------------------

    @staticmethod
    def _refused(attempt: RedisAttempt, sent: float) -> RedisAttempt:
        """Note the attempt's first refusal."""
        if attempt.since is None:
            attempt.since = sent
        return attempt

    def _acquire_call(self, attempt: RedisAttempt) -> Any:
        keys, args = self._acquire_args(attempt)
        return lambda node: node.run(node.acquire, keys, args)

    def _acquire_args(self, attempt: RedisAttempt) -> tuple[list[str], list[Any]]:
        name = attempt.name
        k = self._keys(name)
        args = [
            attempt.owner, ms(attempt.ttl), name, attempt.holder[1],
            WAITER_LEASE_MS, k.signal_prefix, "",
        ]  # fmt: skip
        since = attempt.since
        starving = since is not None and time.monotonic() - since >= STARVE_AFTER
        if self.fair or (starving and self.queues_waiters):
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

    def _outcome(self, reply: Any, attempt: RedisAttempt, sent: float) -> int | Grant | None:
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
        self._refused(attempt, sent).holder_pttl_ms = pttl_ms
        if queued_at is not None:
            attempt.queued_at = queued_at
        return None

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        """One attempt on its own (the acquire loop uses a RedisAttempt's try_acquire)."""
        return self._try_acquire(
            MutexOps(self).attempt(name, owner, ttl, ({}, holder), renew, None)
        )

    def _try_acquire(self, attempt: Any) -> int | Grant | None:
        handed = take_handed(attempt)
        if handed is not None:
            return handed  # wait() saw the previous holder hand the lock over
        call = self._acquire_call(attempt)
        sent = time.monotonic()
        return self._outcome(self._single(attempt.name, call), attempt, sent)

    def do_release(self, name: str, owner: str) -> bool:
        return self._run_bool(name, self._release_call(name, owner))

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        lock_key, ttl_ms = self._keys(name).lock, ms(ttl)
        return self._run_bool(
            name, lambda node: node.run(node.extend, [lock_key], [owner, ttl_ms])
        )

    def do_adopt(self, name: str, owner: str, new_owner: str, ttl: float, state: Any) -> bool:
        lock_key, ttl_ms = self._keys(name).lock, ms(ttl)
        return self._run_bool(
            name, lambda node: node.run(node.adopt, [lock_key], [owner, new_owner, ttl_ms])
        )

    def do_check(self, name: str, owner: str) -> bool:
        lock_key = self._keys(name).lock
        mine = f"{owner}:".encode()
        return self._run_bool(
            name, lambda node: as_bytes(node.command("GET", lock_key) or b"").startswith(mine)
        )

    def _break_call(self, name: str, token: int | None, compare: str) -> Any:
        k = self._keys(name)
        # The marker is per request: a retry of this break, not a later one.
        keys = [*self._lock_keys(k), f"{k.done_prefix}break:{secrets.token_hex(8)}"]
        wanted = "" if token is None else str(token)
        args = [
            "", "", name, "", WAITER_LEASE_MS, k.signal_prefix, "", wanted, compare, self._done_ms,
        ]  # fmt: skip
        return lambda node: node.run(node.break_, keys, args)

    def do_break(self, name: str, token: int | None) -> bool:
        return bool(self._single(name, self._break_call(name, token, "eq")))

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        wake = self._keys(PROBE_NAME).wake
        return "Redis " + self._single("", lambda node: ask_version(node, wake)), ()

    @property
    def tells_server_time(self) -> bool:
        """Whether ``do_server_time`` reads the clock leases end on (``clocks.py``).

        Not on a Cluster: its masters each end their keys on their own clock.
        """
        return not self.cluster

    def do_server_time(self) -> float | None:
        """Redis ``TIME``, in seconds since the epoch; None on a Cluster."""
        if not self.tells_server_time:
            return None
        seconds, micros = self._single("", lambda node: node.command("TIME"))
        return int(seconds) + int(micros) / 1_000_000

    def _abandon(self, attempt: RedisAttempt) -> None:
        plan = self._abandon_plan(attempt)
        if plan is not None:
            keys, args = plan
            self._single(attempt.name, lambda node: node.run(node.abandon, keys, args))

    def _abandon_plan(self, attempt: RedisAttempt) -> tuple[list[str], list[Any]] | None:
        """The ABANDON call ``_abandon`` makes, or None if there is nothing to leave."""
        if not self.fair and attempt.queued_at is None:
            return None  # an unfair waiter that never joined the queue: nothing to leave
        name, owner = attempt.name, attempt.owner
        k = self._keys(name)
        keys = [*self._lock_keys(k), k.signal_prefix + owner]
        args = [owner, "", name, "", WAITER_LEASE_MS, k.signal_prefix, ""]
        return keys, args

    def do_list(self, prefix: str) -> list[LockInfo]:
        return list(self.do_iter_list(prefix))

    def do_iter_list(self, prefix: str) -> Iterator[LockInfo]:
        """Page by page over each shard's index (LIST), shards merged by name."""
        node = self.nodes[0]
        try:
            yield from iter_node(node, self._tags, prefix, self.alias)
        except CLIENT_ERRORS as e:
            raise self._unavailable(prefix, e, node) from e

    def _get_call(self, name: str) -> Callable[[Node], dict[str, LockInfo]]:
        lock_key, alias = self._keys(name).lock, self.alias
        return lambda node: get_lease(node, lock_key, name, alias)

    def do_get(self, name: str) -> LockInfo | None:
        """The live lease on exactly ``name``, or None; one script on the server."""
        found: dict[str, LockInfo] = self._single(name, self._get_call(name))
        return found.get(name)

    def _block(self, attempt: RedisAttempt, remaining: float | None) -> None:
        """Block on the wake-up list until a release, or a fallback re-check.

        The fallback is never longer than half the holder's remaining lease (or
        that lease plus a millisecond when it is short), nor than WAIT_CAP, so a
        lost wake-up or a holder that died cannot strand a waiter. In fair
        mode the wake-up is the hand-over itself: "token:granted_us:lease_ms".
        """
        plan = self._wait_plan(attempt, remaining)
        if plan is None:
            return
        key, timeout = plan
        answered = attempt.answered
        for i, node in enumerate(self.nodes):
            if node.stuck() or (answered is not None and i not in answered):
                continue  # Redlock: a master that does not answer would hold us up
            try:
                # On the direct path too: the woken waiter's next step is the
                # critical path of a hand-over.
                popped = node.command("BLPOP", key, round(timeout, 3))
            except CLIENT_ERRORS:
                continue  # Redlock: that master is down; block on the next one
            self._woken(attempt, popped)
            return
        time.sleep(timeout)

    def _wait_plan(
        self, attempt: RedisAttempt, remaining: float | None
    ) -> tuple[str, float] | None:
        """The list ``wait()`` blocks on and for how long; None: do not block."""
        holder_ms = attempt.holder_pttl_ms
        if holder_ms is None:
            timeout = min(self._blocking_cap, WAIT_CAP)
        else:
            # A PTTL of 0 is a lease in its last millisecond: expiry pushes
            # no wake-up, so re-check just after it (CI once waited WAIT_CAP).
            fallback = max(holder_ms / 2000, min(holder_ms / 1000 + 0.001, 0.05))
            timeout = min(self._blocking_cap, fallback)
        if remaining is not None:
            timeout = min(timeout, remaining)
        if timeout < 0.001:
            return None
        k = self._keys(attempt.name)
        if attempt.queued_at is not None:
            return k.signal_prefix + attempt.owner, timeout
        if attempt.since is not None and self.queues_waiters and not self.fair:
            # Wake when this waiter may join the queue, if that comes first;
            # once it has passed, the next attempt queues and no cap applies.
            until_queue = attempt.since + STARVE_AFTER - time.monotonic()
            if until_queue > 0.001:
                timeout = min(timeout, until_queue)
        return k.wake, timeout

    @staticmethod
    def _woken(attempt: RedisAttempt, popped: Any) -> None:
        """A BLPOP returned: in fair mode, what it popped is the hand-over."""
        if popped and attempt.queued_at is not None:
            attempt.handed = handed_over(attempt.queued_at, text(popped[1]))


class RedisBackend(RedisSemaphores, RedisParking, RedisRenewals, RedisLocks):
    """Leases in Redis on one server, a Cluster or a django-redis pool.

    The mutex core (:class:`RedisLocks`) with three parts: semaphores and
    read/write locks (``semaphores.py``), parked Celery tasks (the same
    module) and the watchdog's batched renewals (``renewals.py``).
    """


_backends: weakref.WeakSet[RedisLocks] = weakref.WeakSet()


def _reset_after_fork() -> None:
    # A forked child has none of the parent's threads: Redlock's pools would
    # queue calls nobody runs, and their counters would say a master is stuck.
    # Its nodes (and their connections) are made anew on first use.
    for backend in list(_backends):
        backend._nodes = None


os.register_at_fork(after_in_child=_reset_after_fork)
