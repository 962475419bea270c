"""The handle of a granted lease: :class:`HeldLock` (its ticket is in ``tickets.py``).

Each acquisition yields a :class:`HeldLock`: the lease actually granted, with
its fencing token; ``held.detach()`` turns it into a ticket that another
process adopts.

A lease can be lost while it is held. Walk through it in time:

    t0  A acquires "report" with ttl=30 and gets fencing token 41.
    t1  A's process freezes (GC pause, SIGSTOP, a slow network) for 40 s;
        the watchdog thread freezes with it and cannot renew.
    t30 The lease expires by the lock service's clock.
    t31 B acquires "report" and gets token 42.
    t40 A resumes. Until it talks to the service it cannot know.

``held.ensure()`` asks the service and raises :class:`LockLost` at t40, and the
watchdog's next renewal marks the handle lost and sends ``lock_lost``. Neither
closes the gap between a check and a write, so writes that must not be
repeated carry ``held.token`` and the storage refuses the older token.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from ._validation import validate_ttl
from .backends.limits import RW_LIMIT
from .exceptions import BackendUnavailable, LockLost, LockNotOwned
from .leases import DETACHED, HELD, LOST, RELEASED, LeaseAccounting, Request
from .leases import RETRY_FRACTION as RETRY_FRACTION
from .signals import lock_acquired, lock_detached, lock_released
from .tickets import TICKET_VERSION as TICKET_VERSION
from .tickets import Ticket as Ticket
from .watchdog import get_watchdog

if TYPE_CHECKING:
    from .backends.protocol import LeaseOps, LockService
    from .backends.types import LockInfo

logger = logging.getLogger("django_dlock")

_INHERITED = "was inherited through fork(): the lease belongs to the parent process"

# Bumped in a child after fork(): a handle made before the fork belongs to the
# parent, and the child must neither release nor renew its lease.
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class HeldLock(LeaseAccounting):
    """A lease that was granted: its name, fencing token and owner.

    Use :meth:`ensure` before work that depends on still holding the lock,
    :meth:`extend` to push the expiry out by hand, and :meth:`release` (or
    leave the ``with`` block) when done. While ``renew`` is on (the default)
    the process's watchdog renews the lease every ``ttl / 3`` seconds.
    """

    # The backend itself (``locks[alias]``), whatever the kind of lease.
    backend: LockService
    # The kind of lease (``backends/ops.py``): a mutex, or a slot of a
    # semaphore or read/write lock; every call to the lease goes through it.
    ops: LeaseOps
    #: The lock's name.
    name: str
    #: The fencing token: an integer strictly increasing per name, never reused.
    token: int
    #: The owner id the lock service stores with the lease (unique per acquisition).
    owner: str
    #: The lease's length in seconds, as last granted (``extend()`` changes it).
    ttl: float
    #: The holder metadata stored with the lease (host, pid, thread, what was
    #: passed as ``metadata=``); what ``manage.py locks`` shows.
    holder: dict[str, Any]
    #: Why the lease was found lost (a renewal or release was refused, it ran
    #: out), or None while it was not.
    lost_reason: str | None
    _mutex: threading.Lock
    _state: str
    _expires: float
    _renew_enabled: bool
    _fork_generation: int
    _forgotten: weakref.finalize[..., Any] | None
    #: Seconds the acquisition waited for this lease (0 for an adopted one).
    waited: float
    #: Whether the acquisition was refused at least once before the grant.
    contended: bool
    #: Whether the lease was handed over (``adopt()`` of a ticket), not granted here.
    adopted: bool
    #: The ``time.monotonic()`` instant the lease was granted here.
    acquired_at: float
    #: The key template the name was made from (``@lock``, ``@locked_task``,
    #: guarded views), else None: the pattern metrics label it by.
    template: str | None
    # The watchdog's: a renewal is queued or under way.
    renewing: bool
    # The watchdog's: bumped whenever it (re)schedules or cancels this handle.
    watchdog_generation: int

    def __init__(
        self,
        backend: LockService,
        ops: LeaseOps,
        name: str,
        owner: str,
        token: int,
        *,
        ttl: float,
        expires: float,
        lease: float,
        holder: dict[str, Any],
        renew: bool,
        waited: float = 0.0,
        contended: bool = False,
        adopted: bool = False,
        template: str | None = None,
    ) -> None:
        """The handle of a lease the lock service just granted to ``owner``.

        This is how a backend (through ``BaseLockBackend``'s acquire loop and
        ``adopt()``) hands a lease to its caller; application code gets
        handles by acquiring. ``ops`` is the kind of lease on ``backend``
        (``backends/ops.py``), ``template`` the key template ``name`` was made
        from, if any. ``expires`` is a ``time.monotonic()`` instant no
        later than the lease's end by the service's clock (for a plain grant:
        when the request was sent, plus the TTL), ``lease`` its length (shorter
        than ``ttl`` for a hand-over: the handle extends it), ``holder`` the
        metadata stored with it. With ``renew`` the process's watchdog renews
        it every ``ttl / 3`` seconds. ``waited`` and ``contended`` describe
        the acquisition, ``adopted`` a lease handed over by ``detach()`` (for
        ``lock_acquired``). Sends ``lock_acquired``; if a
        receiver raises, the lease is released and the error propagates.
        """
        self.backend = backend
        self.ops = ops
        self.name = name
        self.owner = owner
        self.token = int(token)
        self.ttl = ttl
        self.holder = holder
        self.lost_reason = None
        self.waited = waited
        self.contended = contended
        self.adopted = adopted
        self.acquired_at = time.monotonic()
        self.template = template
        self._mutex = threading.Lock()
        self._state = HELD
        # ``expires`` is when the lease ends at the earliest by our clock (for a
        # plain grant: when we sent the request, plus the TTL, since the
        # service started counting no earlier than that).
        self._expires = expires - backend.drift(lease)
        self._confirmed = (expires - lease, lease)
        self._requests = []
        self._renew_enabled = renew
        self._fork_generation = _fork_generation
        self.renewing = False
        self.watchdog_generation = 0
        self._forgotten = None
        if renew and backend.supports_shared_leases:
            # Renewing this process's other leases would keep this one alive
            # after the handle is dropped; the finalizer ends it on time.
            self._expiry_cell = [self._expires]
            self._forgotten = weakref.finalize(
                self, _release_forgotten, ops, name, owner, self._expiry_cell, _fork_generation
            )
            self._forgotten.atexit = False
        if renew:
            # Due a third of the lease after the request was sent, not after now.
            due = self._confirmed[0] + min(ttl, lease) / 3
            get_watchdog().schedule(self, max(0.0, due - self.acquired_at))
        elif lease < ttl:
            # Granted less than asked (a hand-over) and nobody will renew it.
            self.extend(ttl)
        if lock_acquired.receivers:
            try:
                lock_acquired.send(
                    sender=type(backend),
                    backend=backend.alias,
                    name=name,
                    token=self.token,
                    held=self,
                    waited=waited,
                    contended=contended,
                    adopted=adopted,
                )
            except BaseException:
                self.release_quietly()
                raise

    def __repr__(self) -> str:
        return (
            f"<HeldLock {self.name!r} token={self.token} backend={self.alias!r} "
            f"state={self._state}>"
        )

    @property
    def alias(self) -> str:
        """The ``DLOCK_BACKENDS`` alias of the backend that holds the lease."""
        return self.backend.alias

    @property
    def released(self) -> bool:
        """True once :meth:`release` (or the end of the ``with`` block) let the lease go."""
        return self._state == RELEASED

    @property
    def detached(self) -> bool:
        """True once :meth:`detach` handed the lease to whoever adopts its ticket."""
        return self._state == DETACHED

    @property
    def lost(self) -> bool:
        """True once the lease is known to be gone, or must have run out by our clock.

        Local knowledge only; :meth:`ensure` asks the lock service.
        """
        return self._state == LOST or (self._state == HELD and self.expires_in <= 0)

    @property
    def expires_at(self) -> float:
        """The ``time.monotonic()`` instant the lease runs out by our conservative estimate.

        No later than the backend's ``session_end()``: on ZooKeeper, the
        session timeout after the service last answered this process.
        """
        return min(self._expires, self.backend.session_end(self.owner))

    @property
    def expires_in(self) -> float:
        """Seconds until the lease runs out by our conservative estimate, unless renewed."""
        return min(self._expires, self.backend.session_end(self.owner)) - time.monotonic()

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless the lock service confirms the lease is ours now.

        One round trip. The confirmation is for this instant: a write that
        follows should still carry :attr:`token`.
        """
        self._before_ensure()
        if not self.ops.check(self.name, self.owner):
            self._ensure_refused()

    @property
    def inherited(self) -> bool:
        """True in a process forked from the one that holds the lease: it is not ours here."""
        return self._fork_generation != _fork_generation

    def _before_ensure(self) -> None:
        if self.inherited:
            raise self._error(LockLost, _INHERITED)
        if self._state in (RELEASED, DETACHED):
            raise self._error(LockLost, f"was {self._state}")
        if self._state == LOST:
            raise self._error(LockLost, f"was lost: {self.lost_reason}")
        if self.expires_in <= 0:
            self._mark_lost("its lease ran out before it could be renewed")
            raise self._error(LockLost, f"was lost: {self.lost_reason}")

    def _ensure_refused(self) -> None:
        self._mark_lost("the lock service no longer has this lease (expired or broken)")
        raise self._error(LockLost, f"was lost: {self.lost_reason}")

    @property
    def kind(self) -> str:
        """``"lock"`` (a mutex), ``"semaphore"`` or ``"rwlock"``: what this handle holds."""
        if self.ops.limit is None:
            return "lock"
        return "rwlock" if self.ops.limit == RW_LIMIT else "semaphore"

    @property
    def limit(self) -> int | None:
        """The semaphore's limit (``RW_LIMIT`` for a read/write lock); None for a mutex."""
        return self.ops.limit

    def get(self) -> LockInfo | None:
        """This lease as the lock service lists it now, or None once it is gone; one lookup.

        For a mutex, ``locks[alias].get(name)`` if it still has this handle's
        token; for a semaphore's or read/write lock's slot, its holder in
        ``locks[alias].semaphore(name)``, never a mutex of the same name.
        """
        return self.ops.get(self.name, self.token)

    def break_lock(self) -> bool:
        """Break this lease, by its fencing token, whoever holds the name now; False if gone.

        ``locks[alias].break_lock(name, token)`` for a mutex,
        ``locks[alias].break_slot(name, token)`` for a slot: the lease this
        handle names, never another. The handle finds out as any holder
        would (``LockLost`` at its next check or renewal).
        """
        return self.ops.break_lease(self.name, self.token)

    def extend(self, ttl: float | None = None) -> None:
        """Make the lease run ``ttl`` seconds from now (default: its current TTL).

        The new TTL also becomes the renewal period's basis. Raises
        :class:`LockNotOwned` (a :class:`LockLost`) if the lease is gone.
        """
        request = self._sending(self._before_extend(ttl))
        try:
            extended = self.ops.extend(self.name, self.owner, request.ttl)
        except BaseException:
            self._answered(request, None)
            raise
        self._after_extend(extended, request)

    def _before_extend(self, ttl: float | None) -> float:
        ttl = self.ttl if ttl is None else validate_ttl(ttl)
        if self.inherited:
            raise self._error(LockNotOwned, f"cannot be extended: it {_INHERITED}")
        if self._state != HELD:
            raise self._error(LockNotOwned, f"cannot be extended: it was {self._state}")
        # The renewal basis from now on: a renewal sent after this one carries it.
        self.ttl = ttl
        return ttl

    def _after_extend(self, extended: bool, request: Request) -> None:
        self._answered(request, extended)
        if not extended:
            self._mark_lost("extend was refused: the lease expired or was broken")
            raise self._error(LockNotOwned, "cannot be extended: the lease is gone")

    def release(self) -> None:
        """Release the lease if this handle still owns it.

        Releasing twice, or after :meth:`detach`, is a no-op. Raises
        :class:`LockNotOwned` when the lease had already expired or been
        broken, since then the work done under it was not protected to the end.
        """
        was_lost = self._before_release()
        if was_lost is not None:
            self._after_release(self.ops.release(self.name, self.owner), was_lost)

    def _before_release(self) -> bool | None:
        """Mark the handle released; None if it already was (nothing to do), else was_lost.

        Also None in a process forked while the lease was held: the lease is
        the parent's, and leaving an inherited ``with`` block must not end it.
        """
        if self.inherited:
            return None
        with self._mutex:
            if self._state in (RELEASED, DETACHED):
                return None
            was_lost = self._state == LOST
            self._state = RELEASED
        # Stop renewing first: if the release cannot reach the service, the
        # lease must still run out rather than be kept alive by the watchdog.
        get_watchdog().cancel(self)
        self._remembered()
        return was_lost

    def _after_release(self, released: bool, was_lost: bool) -> None:
        if released:
            # An async waiter of this name in this process tries at once
            # rather than at the end of its backoff (backends/offload.py).
            self.backend.offload.wakes.wake(self.name)
        if not released:
            if not was_lost:
                self.lost_reason = "release was refused: the lease expired or was broken"
                self._send_lost()
            raise self._error(
                LockNotOwned, "was not held at release: the lease expired or was broken"
            )
        if lock_released.receivers:
            self._send_ended(lock_released)
        if was_lost:
            # lock_lost was sent: from then on the handle could not vouch for
            # the lease, so the work after it was not known to be protected,
            # even though the service still had the lease to release.
            raise self._error(
                LockLost, f"was released, but had been declared lost: {self.lost_reason}"
            )

    # --- async: the backend's awaitable primitives (native, or a worker thread).

    async def aensure(self) -> None:
        """:meth:`ensure`, awaited."""
        self._before_ensure()
        if not await self.ops.acheck(self.name, self.owner):
            self._ensure_refused()

    async def aextend(self, ttl: float | None = None) -> None:
        """:meth:`extend`, awaited."""
        request = self._sending(self._before_extend(ttl))
        try:
            extended = await self.ops.aextend(self.name, self.owner, request.ttl)
        except BaseException:
            self._answered(request, None)
            raise
        self._after_extend(extended, request)

    async def arelease(self) -> None:
        """:meth:`release`, awaited.

        Cancelling the await does not cancel the release: it goes on in the
        background (a task kept referenced until done, or a thread of the
        backend's if the event loop closes first) and its outcome is logged.
        Otherwise a release cancelled before it was sent would leave the
        lease held by nobody until its TTL ran out.
        """
        was_lost = self._before_release()
        if was_lost is None:
            return
        releasing = asyncio.ensure_future(self.ops.arelease(self.name, self.owner))
        _background.add(releasing)
        releasing.add_done_callback(_background.discard)
        try:
            released = await asyncio.shield(releasing)
        except asyncio.CancelledError:
            releasing.add_done_callback(functools.partial(self._released_late, was_lost))
            raise
        self._after_release(released, was_lost)

    def _released_late(self, was_lost: bool, releasing: asyncio.Future[bool]) -> None:
        """The outcome of a release whose caller was cancelled: logged, never raised."""
        if releasing.cancelled():
            # The event loop is closing and cancelled it: finish in a thread.
            # (A release that had already been sent is then sent again; being
            # owner-checked, the second finds nothing and is only logged.)
            self.backend.offload.submit("ops", self._release_again, was_lost)
            return
        error = releasing.exception()
        if error is not None:
            logger.warning(
                "Releasing %r (its caller was cancelled) failed: %r", self, error, exc_info=error
            )
            return
        try:
            self._after_release(releasing.result(), was_lost)
        except LockLost as e:
            logger.warning("%s", e)

    def _release_again(self, was_lost: bool) -> None:
        try:
            released = self.ops.release(self.name, self.owner)
        except Exception:
            logger.exception("Could not release lock %r on %r", self.name, self.alias)
            return
        if released:
            self._after_release(True, was_lost)
        else:
            logger.debug("%r: nothing left to release after the cancelled release", self)

    def detach(self) -> dict[str, Any]:
        """Hand the lease over: stop renewing it here and return a ticket for another process.

        The lease stays held on the lock service and runs out after its TTL
        unless ``locks[alias].adopt(ticket)`` (in any process, on a backend of
        the same settings) takes it up first. The ticket is JSON-serializable,
        so it can travel in a message: ``@locked_task(scope="queue")`` sends
        it with the task. This handle no longer owns the lease: releasing it
        is a no-op and :meth:`ensure` raises :class:`LockLost`.

        A mutex's lease only: a semaphore's or read/write lock's slot raises
        :class:`TypeError`, and stays held here.
        """
        if self.inherited:
            raise self._error(LockNotOwned, f"cannot be detached: it {_INHERITED}")
        if self.ops.limit is not None:
            raise TypeError(
                f"{self.kind} {self.name!r} on {self.alias!r} cannot be detached: a slot "
                "is one of a semaphore's leases and cannot be handed to another process."
            )
        with self._mutex:
            if self._state != HELD:
                raise self._error(LockNotOwned, f"cannot be detached: it was {self._state}")
            self._state = DETACHED
        get_watchdog().cancel(self)
        self._remembered()
        try:
            state = self.ops.detach(self.name, self.owner)
        except BaseException:
            with self._mutex:
                self._state = HELD
            if self._renew_enabled:
                get_watchdog().schedule(self, 0)
            raise
        if lock_detached.receivers:
            self._send_ended(lock_detached)
        return Ticket(
            self.alias, self.name, self.owner, self.token, self.ttl, self.holder, state
        ).to_dict()

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        release_on_exit(self, exc_type is not None)

    # --- internals -------------------------------------------------------------------

    def _error(self, cls: type[LockLost], what: str) -> LockLost:
        return cls(
            f"Lock {self.name!r} (token {self.token}) on backend {self.alias!r} {what}.",
            name=self.name,
            backend=self.alias,
        )

    def release_quietly(self) -> bool:
        """:meth:`release`, logging instead of raising an error (for cleanup paths).

        True if the lease was held to the end and is released (or was
        already). A lease found lost is logged at INFO, without a traceback:
        its loss was logged as a WARNING, and ``lock_lost`` sent, when it was
        found (:attr:`lost_reason` says how). A release the lock service did
        not answer is a WARNING: the lease runs out after its TTL. Anything
        else is an ERROR with its traceback.
        """
        try:
            self.release()
        except Exception as e:
            self._release_failed(e)
            return False
        return True

    async def arelease_quietly(self) -> bool:
        """:meth:`release_quietly`, awaited."""
        try:
            await self.arelease()
        except Exception as e:
            self._release_failed(e)
            return False
        return True

    def _release_failed(self, error: Exception) -> None:
        if isinstance(error, LockLost):
            logger.info("%s", error)
        elif isinstance(error, BackendUnavailable):
            logger.warning(
                "Could not release lock %r on %r; it runs out after its TTL: %s",
                self.name, self.alias, error,
            )  # fmt: skip
        else:
            logger.error("Could not release lock %r on %r", self.name, self.alias, exc_info=error)


#: Releases whose caller was cancelled, kept referenced until they are done.
_background: set[asyncio.Future[Any]] = set()


def release_on_exit(held: HeldLock, body_raised: bool) -> None:
    """Release at the end of a ``with`` block or decorated call.

    If the body completed, a lost lease is reported by raising: the block ran
    (partly) unprotected and the caller must know. If the body raised, its
    exception wins and the release problem is only logged.
    """
    try:
        held.release()
    except (LockLost, BackendUnavailable):
        if not body_raised:
            raise
        logger.warning("Releasing %r after an exception failed", held, exc_info=True)


async def arelease_on_exit(held: HeldLock, body_raised: bool) -> None:
    """``release_on_exit``, awaited."""
    try:
        await held.arelease()
    except (LockLost, BackendUnavailable):
        if not body_raised:
            raise
        logger.warning("Releasing %r after an exception failed", held, exc_info=True)


def _release_forgotten(
    ops: LeaseOps, name: str, owner: str, expiry: list[float], generation: int
) -> None:
    """Finalizer of a held handle nobody references: release it when it would have run out."""
    if generation != _fork_generation:
        return  # freed in a forked child: the lease is the parent's

    def release() -> None:
        if ops.release(name, owner):
            logger.info("Released the lease of forgotten handle %r on %r", name, ops.backend.alias)

    watchdog = get_watchdog()
    watchdog.call_at(expiry[0], lambda: watchdog.renewer(ops.backend.alias).submit(release))
