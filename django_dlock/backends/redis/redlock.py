"""RedlockBackend: a lease is held while a majority of independent Redis masters hold it.

Settings::

    "BACKEND": "django_dlock.backends.redis.RedlockBackend",
    "LOCATION": ["redis://10.0.0.1:6379/0", "redis://10.0.0.2:6379/0", "redis://10.0.0.3:6379/0"],

Each master runs the same scripts as a single server (``scripts.py``); an
operation succeeds when a majority (the quorum) of masters says so. See
``docs/backends/redis.md`` for what Redlock does and does not guarantee.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from operator import attrgetter
from typing import Any

from django.core import checks

from redis.exceptions import RedisError

from ...exceptions import BackendUnavailable, LockConfigurationError
from ..base import Grant, LockInfo
from ..probe import PROBE_NAME
from .backend import RedisLocks
from .connections import Node, ask_version, text
from .listing import list_node

#: A master with calls out that has answered none for this long gets no new
#: ones until they return (they end by the socket timeout at the latest).
STUCK_AFTER = 0.5
#: Threads per master for calling the masters at once.
POOL_PER_MASTER = 4
#: How long an acquisition's try waits for the masters once its timeout has
#: run out (or with ``timeout=0``): one round trip, at most (seconds).
ROUND_TRIP = STUCK_AFTER


class Master(Node):
    """A Redlock master: a Node with its own threads, called at once with the others."""

    def __init__(self, client: Any, label: str, *, dedicated: bool, retries: int) -> None:
        super().__init__(client, label, dedicated=dedicated, retries=retries)
        #: Calls out and not returned, and when a call last started with none
        #: out or returned (however: an error counts).
        self.outstanding = 0
        self.progress = time.monotonic()
        self._count = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        #: Per lock name, the last call submitted and not yet done.
        self._tails: dict[str, Future[Any]] = {}
        self._order = threading.Lock()

    @property
    def pool(self) -> ThreadPoolExecutor:
        """This master's threads, so that one that hangs ties up only its own."""
        pool = self._pool
        if pool is None:
            with self._count:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        max_workers=POOL_PER_MASTER, thread_name_prefix="django-dlock-redlock"
                    )
                pool = self._pool
        return pool

    def call(self, call: Callable[[Node], Any]) -> Any:
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

    def submit(self, name: str, call: Callable[[Node], Any]) -> Future[Any]:
        """``call(self)`` on this master's pool, after its calls for ``name``.

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

    def _relay(self, call: Callable[[Node], Any], future: Future[Any]) -> None:
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

    def close(self) -> None:
        super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class RedlockBackend(RedisLocks):
    """Redlock over the independent masters listed in ``LOCATION``: the mutex core only.

    No semaphores (each master would count a semaphore's holders on its
    own, and no majority of such counts bounds them), no parked tasks (a
    queue on one master is no majority's), and renewals one lease a call,
    each on a majority of the masters: it declares none of RedisBackend's
    parts.
    """

    @property
    def tells_server_time(self) -> bool:
        return False  # each master ends its keys on its own clock

    redlock = True
    # Each master would queue and hand over on its own, and a hand-over by one
    # master is not a majority's grant: Redlock waiters never queue.
    queues_waiters = False
    # A master that is down must cost one refused connection, not retries.
    retries = 0
    node_class = Master
    allowed_options = RedisLocks.allowed_options - {"connection"}

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        if self.fair or self.cluster:
            raise LockConfigurationError(
                f"Lock backend {alias!r}: Redlock over independent masters cannot be "
                "combined with 'fair' or 'cluster'.",
                alias=alias,
            )
        self.quorum = len(self.locations) // 2 + 1
        self.native_async = False

    def _locations(self) -> list[str]:
        if isinstance(self.location, str) or (
            isinstance(self.location, list | tuple) and len(self.location) < 2
        ):
            raise self.config_error(
                "Redlock needs LOCATION to be a list of two or more independent masters' "
                "redis:// URLs; for one server use django_dlock.backends.redis.RedisBackend."
            )
        return super()._locations()

    def drift(self, ttl: float) -> float:
        """The masters' clocks may drift; count on 1 % less, minus 2 ms."""
        return ttl * 0.01 + 0.002

    def check(self) -> list[checks.CheckMessage]:
        messages = super().check()
        if len(self.locations) % 2 == 0:
            messages.append(
                checks.Warning(
                    f"Lock backend {self.alias!r}: Redlock over an even number of masters "
                    f"({len(self.locations)}) tolerates no more failures than one fewer.",
                    id="django_dlock.W001",
                )
            )
        return messages

    # --- running a call on every master -----------------------------------------------

    def _on_each(
        self,
        name: str,
        call: Any,
        decided: Callable[[list[Any]], bool] | None = None,
        deadline: float | None = None,
    ) -> list[Any]:
        """Run ``call(master)`` on every master; an exception is recorded as the result.

        The masters are called at once, each on a thread of its own pool, and
        this returns as soon as ``decided(results)`` says the answers in hand
        settle the outcome (results not in yet stay ``_PENDING``), or when
        ``socket_timeout`` has passed: a master that accepts and never
        answers costs one timeout, not one per master per call. A master with
        a call still out past such a deadline is not sent another until it
        answers (it counts as unavailable) once it has answered nothing for
        STUCK_AFTER seconds, so it cannot tie up the pool. ``deadline`` (a
        ``time.monotonic()``) ends the wait sooner: an acquisition's timeout.
        """
        nodes = self.nodes
        results: list[Any] = [_PENDING] * len(nodes)
        futures: dict[Future[Any], int] = {}
        for i, node in enumerate(nodes):
            if node.stuck():
                results[i] = self._unavailable(name, _Stuck(node.label), node)
                continue
            assert isinstance(node, Master)
            futures[node.submit(name, call)] = i
        pending = set(futures)
        latest = time.monotonic() + self.socket_timeout
        deadline = latest if deadline is None else min(deadline, latest)
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

    def _run_bool(self, name: str, call: Callable[[Node], Any]) -> bool:
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

    def _try_acquire(self, attempt: Any) -> int | Grant | None:
        name, owner, ttl = attempt.name, attempt.owner, attempt.ttl
        call = self._acquire_call(attempt)
        sent = time.monotonic()
        # Within the caller's timeout, plus one round trip: a master that
        # accepts and never answers (a stopped process, a black hole) must
        # not hold an acquisition past it (issue 28, item 4).
        deadline = None
        if attempt.deadline is not None:
            deadline = max(attempt.deadline, sent + ROUND_TRIP)
        results = self._on_each(name, call, self._settled(_granted), deadline)
        errors = [r for r in results if isinstance(r, BackendUnavailable)]
        outcomes = [self._outcome(r, attempt, sent) for r in results if _answer(r)]
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
        # The undo is sent to every master, and waited for only from those
        # that answered the attempt: a master that did not (stopped, black-
        # holed) gets it after the attempt, in order (Master.submit), whenever
        # it answers, and the caller does not wait for it.
        answered = [i for i, r in enumerate(results) if _answer(r)]
        attempt.answered = tuple(answered)
        self._on_each(
            name,
            self._release_call(name, owner),
            lambda undone: all(undone[i] is not _PENDING for i in answered),
            deadline,
        )
        if len(errors) > len(results) - self.quorum:
            raise errors[0]
        refusals = [
            int(r) for r in results if _answer(r) and not isinstance(r, list) and int(r) < 0
        ]
        # Wait on the soonest-expiring refusal.
        self._refused(attempt, sent).holder_pttl_ms = -max(refusals) - 1 if refusals else None
        return None

    def do_break(self, name: str, token: int | None) -> bool:
        if token is not None:
            # The lease numbered `token` is the one whose largest per-master
            # token it is; unless a master still holds that number, it is gone.
            lock_key, wanted = self._keys(name).lock, str(token)
            values = self._on_each(name, lambda node: node.command("GET", lock_key))
            if not any(
                text(v).split(":", 2)[1] == wanted
                for v in values
                if v is not None and not isinstance(v, Exception)
            ):
                return False
        # "le": each master numbers a lease on its own, and we know the largest.
        results = self._on_each(name, self._break_call(name, token, "le"))
        return any(r == 1 for r in results if not isinstance(r, Exception))

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        versions: set[str] = set()
        warnings = []
        wake = self._keys(PROBE_NAME).wake
        for node in self.nodes:
            try:
                versions.add(ask_version(node, wake))
            except RedisError as e:
                warnings.append(f"Redlock master {node.label} does not answer: {e}")
        if len(versions) == 0 or len(self.nodes) - len(warnings) < self.quorum:
            raise BackendUnavailable(
                f"Fewer than {self.quorum} of {len(self.nodes)} Redlock masters answer on "
                f"backend {self.alias!r}: {'; '.join(warnings)}",
                backend=self.alias,
            )
        return "Redis " + ", ".join(sorted(versions)), tuple(warnings)

    def do_list(self, prefix: str) -> list[LockInfo]:
        per_node: list[dict[str, LockInfo]] = []
        errors: list[RedisError] = []
        for node in self.nodes:
            try:
                per_node.append(list_node(node, self._tags, prefix, self.alias))
            except RedisError as e:
                errors.append(e)
        self._need_quorum(prefix, len(per_node), errors)
        return self._merge_quorum(per_node)

    def do_iter_list(self, prefix: str) -> Iterator[LockInfo]:
        # A lease is listed when a majority holds it: every master's leases
        # are read before the first is known (not page by page).
        return iter(sorted(self.do_list(prefix), key=attrgetter("name")))

    def do_get(self, name: str) -> LockInfo | None:
        """``name``'s lease as a majority of masters holds it (as do_list), or None.

        One GET script per master, the masters called at once. A master that
        fails counts as not holding it; with fewer than a majority answering,
        nobody can say, and it raises ``BackendUnavailable``.
        """
        results = self._on_each(name, self._get_call(name))
        answers = [r for r in results if _answer(r)]
        self._need_quorum(name, len(answers), [r for r in results if isinstance(r, Exception)])
        merged = self._merge_quorum(answers)
        return merged[0] if merged else None

    def _need_quorum(self, name: str, answered: int, errors: list[Any]) -> None:
        """Raise unless a majority of masters answered a read."""
        if answered >= self.quorum:
            return
        raise BackendUnavailable(
            f"Only {answered} of {len(self.nodes)} Redlock masters answered on backend "
            f"{self.alias!r} (a majority, {self.quorum}, is needed to say who holds "
            f"{name!r}): {'; '.join(str(e) for e in errors)}",
            name=name or None,
            backend=self.alias,
        )

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


_PENDING: Any = object()


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
