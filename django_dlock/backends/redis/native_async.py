"""A Redis acquisition (:class:`RedisAttempt`) and RedisBackend's native async path.

The native path (single server; ``aio.py``): tries, waits, releases.

A mixin of :class:`~.backend.RedisBackend`, as its renewals and semaphores
are. Without native async (a Cluster, Redlock, django-redis) the ``ado_*``
methods defer to :class:`~django_dlock.backends.base.BaseLockBackend`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...clocks import ms
from ...exceptions import BackendUnavailable
from ..base import Attempt, BaseLockBackend, Grant
from .aio import AsyncNode
from .connections import CLIENT_ERRORS, Node, as_bytes, text
from .scripts import ABANDON, ACQUIRE, EXTEND, KEEP, RELEASE, WAITER_LEASE_MS, Keys
from .waiters import SELF_CHECK, Waiter, handed_over, take_handed


class RedisAttempt(Attempt):
    """One acquire call, and what it has learned while refused.

    Its waits block on a Redis list (BLPOP) that a release pushes to; once
    queued (``fair``, or an unfair waiter starving), on its own list, which
    the previous holder pushes the hand-over to. The same object serves the
    sync loop and, on one server, the asyncio one.
    """

    backend: RedisNativeAsync
    #: When it was first refused, by our clock (unfair waiters queue after
    #: STARVE_AFTER); None until then.
    since: float | None = None
    #: The holder's lease left at the latest refusal, in ms (None: unknown).
    #: 0 is a lease within a millisecond of its end, not an unknown one.
    holder_pttl_ms: int | None = None
    #: Once queued: (our clock when that attempt was sent, server clock in us).
    queued_at: tuple[float, int] | None = None
    #: A lease the previous holder handed over, seen by wait().
    handed: Grant | None = None
    #: What the event loop's notifier knows of it (native async; waiters.py).
    waiter: Waiter | None = None
    #: The server's clock when a try first queued it (async, not native).
    first_queued_us: int | None = None
    #: Redlock: the masters (indexes) that answered the latest try; a wait
    #: blocks on one of them, not on one that may not answer at all.
    answered: tuple[int, ...] | None = None

    def try_acquire(self) -> int | Grant | None:
        return self.backend._try_acquire(self)

    def wait(self, remaining: float | None) -> None:
        self.backend._block(self, remaining)

    def abandon(self) -> None:
        self.backend._abandon(self)

    async def await_free(self, remaining: float | None) -> None:
        # Without native async (a Cluster, Redlock, django-redis): no BLPOP
        # holding a thread and a connection per waiter; polled instead
        # (a hand-over is granted at the next try).
        await super().await_free(remaining)

    def queued_rank(self) -> int | None:
        # The server's clock at the first try that queued it: the queue is in
        # that order (later tries refresh its place, they do not move it).
        if self.queued_at is not None and self.first_queued_us is None:
            self.first_queued_us = self.queued_at[1]
        return self.first_queued_us

    async def atry_acquire(self) -> int | Grant | None:
        return await self.backend.atry_attempt(self)

    async def await_(self, remaining: float | None) -> None:
        await self.backend.ablock_attempt(self, remaining)

    async def aabandon(self) -> None:
        await self.backend.aabandon_attempt(self)


class RedisNativeAsync(BaseLockBackend):
    """The ``a*`` operations of :class:`~.backend.RedisBackend` on one server's asyncio client."""

    native_async: bool
    _anode: AsyncNode
    _keys: Callable[[str], Keys]
    _unavailable: Callable[[str, BaseException, Node], BackendUnavailable]
    _acquire_args: Callable[[RedisAttempt], tuple[list[str], list[Any]]]
    _release_args: Callable[[str, str], tuple[list[str], list[Any]]]
    _outcome: Callable[[Any, RedisAttempt, float], int | Grant | None]
    _abandon_plan: Callable[[RedisAttempt], tuple[list[str], list[Any]] | None]
    _wait_plan: Callable[[RedisAttempt, float | None], tuple[str, float] | None]
    # The sync side of RedisBackend, which RedisAttempt calls.
    _try_acquire: Callable[[RedisAttempt], int | Grant | None]
    _block: Callable[[RedisAttempt, float | None], None]
    _abandon: Callable[[RedisAttempt], None]

    if TYPE_CHECKING:

        @property
        def nodes(self) -> list[Node]: ...

    async def _arun(self, name: str, call: Any) -> Any:
        """Await ``call(async node)``; a RedisError becomes BackendUnavailable."""
        try:
            return await call(self._anode)
        except CLIENT_ERRORS as e:
            raise self._unavailable(name, e, self.nodes[0]) from e

    async def atry_attempt(self, attempt: RedisAttempt) -> int | Grant | None:
        handed = take_handed(attempt)
        if handed is not None:
            self._aforget(attempt)
            return handed
        keys, args = self._acquire_args(attempt)
        queues = args[6] == "1"
        waiter = attempt.waiter
        if waiter is None and queues:
            # Before it is sent: a hand-over may be published before its reply.
            waiter = attempt.waiter = self._notifier().register(attempt.name, attempt.owner)
        elif waiter is not None:
            waiter.sent = time.monotonic()
        sent, reply = await self._arun(attempt.name, lambda a: a.run_timed(ACQUIRE, keys, args))
        result = self._outcome(reply, attempt, sent)
        if result is not None:
            self._aforget(attempt)
        elif waiter is not None:
            waiter.queued = queues
        return result

    def _notifier(self) -> Any:
        return self._anode.notifier(lambda name: self._keys(name).wake, self._akeep)

    def _aforget(self, attempt: RedisAttempt) -> None:
        waiter, attempt.waiter = attempt.waiter, None
        if waiter is not None:
            self._notifier().unregister(waiter)

    async def _akeep(self, name: str, owners: list[str]) -> tuple[int, list[str]]:
        """KEEP for ``owners`` queued on ``name``: (the lock's PTTL, those no longer queued)."""
        k = self._keys(name)
        keys = [k.lock, k.queue, k.queue_deadlines, k.queue_info]
        reply = await self._arun(name, lambda a: a.run(KEEP, keys, [WAITER_LEASE_MS, *owners]))
        return int(reply[0]), [text(owner) for owner in reply[1:]]

    async def ado_release(self, name: str, owner: str) -> bool:
        if not self.native_async:
            return await super().ado_release(name, owner)
        keys, args = self._release_args(name, owner)
        return bool(await self._arun(name, lambda a: a.run(RELEASE, keys, args)))

    async def ado_extend(self, name: str, owner: str, ttl: float) -> bool:
        if not self.native_async:
            return await super().ado_extend(name, owner, ttl)
        keys, args = [self._keys(name).lock], [owner, ms(ttl)]
        return bool(await self._arun(name, lambda a: a.run(EXTEND, keys, args)))

    async def ado_check(self, name: str, owner: str) -> bool:
        if not self.native_async:
            return await super().ado_check(name, owner)
        lock_key = self._keys(name).lock
        value = await self._arun(name, lambda a: a.get(lock_key))
        return as_bytes(value or b"").startswith(f"{owner}:".encode())

    async def aabandon_attempt(self, attempt: RedisAttempt) -> None:
        self._aforget(attempt)
        plan = self._abandon_plan(attempt)
        if plan is not None:
            keys, args = plan
            await self._arun(attempt.name, lambda a: a.run(ABANDON, keys, args))

    async def ablock_attempt(self, attempt: RedisAttempt, remaining: float | None) -> None:
        """Wait on the event loop's notifier (waiters.py), holding no connection.

        A queued waiter waits to be handed the lock, the notifier's keeper
        refreshing its place; any other waits as long as ``_block`` would.
        """
        waiter = attempt.waiter
        if waiter is not None and waiter.queued:
            timeout = SELF_CHECK if remaining is None else min(remaining, SELF_CHECK)
            if timeout < 0.001:
                return
        else:
            plan = self._wait_plan(attempt, remaining)
            if plan is None:
                return
            timeout = plan[1]
            if waiter is None:
                waiter = attempt.waiter = self._notifier().register(attempt.name, attempt.owner)
        try:
            await self._notifier().wait(waiter, timeout)
        except CLIENT_ERRORS as e:  # subscribing failed
            raise self._unavailable(attempt.name, e, self.nodes[0]) from e
        signal, waiter.signal = waiter.signal, None
        if signal is not None and attempt.queued_at is not None:
            attempt.handed = handed_over(attempt.queued_at, signal)
