"""The lock handle: ``lock(...)`` as a context manager, a decorator, or by hand.

``lock(name, ...)`` returns a :class:`Lock`, a reusable description of what to
acquire. Each acquisition yields a :class:`HeldLock`, the lease actually
granted, with its fencing token. ``with lock("x") as held`` keeps the handle
for the block; the decorator acquires per call, so one decorated function is
safe to call from many threads at once.

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

import functools
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar, cast

from . import conf
from ._validation import dump_holder, validate_name, validate_timeout, validate_ttl
from .exceptions import BackendUnavailable, LockLost, LockNotOwned
from .handler import locks
from .keys import KeyTemplate
from .signals import lock_acquired, lock_lost, lock_released
from .watchdog import get_watchdog

if TYPE_CHECKING:
    from .backends.base import BaseLockBackend

logger = logging.getLogger("django_dlock")

F = TypeVar("F", bound=Callable[..., Any])

_HELD, _RELEASED, _LOST, _DETACHED = "held", "released", "lost", "detached"
_INHERITED = "was inherited through fork(): the lease belongs to the parent process"

#: Version of the ticket that ``HeldLock.detach()`` returns and ``adopt()`` reads.
TICKET_VERSION = 1

#: Seconds between renewal retries after an error, as a fraction of the TTL.
RETRY_FRACTION = 0.1

_UNSET: Any = object()

# Bumped in a child after fork(): a handle made before the fork belongs to the
# parent, and the child must neither release nor renew its lease.
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class HeldLock:
    """A lease that was granted: its name, fencing token and owner.

    Use :meth:`ensure` before work that depends on still holding the lock,
    :meth:`extend` to push the expiry out by hand, and :meth:`release` (or
    leave the ``with`` block) when done. While ``renew`` is on (the default)
    the process's watchdog renews the lease every ``ttl / 3`` seconds.
    """

    backend: BaseLockBackend
    name: str
    token: int
    owner: str
    ttl: float
    holder: dict[str, Any]
    lost_reason: str | None
    _mutex: threading.Lock
    _state: str
    _expires: float
    _renew_enabled: bool
    _watch_generation: int
    _fork_generation: int
    _forgotten: weakref.finalize[..., Any] | None
    _renewing: bool
    _expiry_cell: list[float]

    def __init__(self) -> None:
        raise TypeError("HeldLock is created by acquiring a lock, not directly.")

    @classmethod
    def _granted(
        cls,
        backend: BaseLockBackend,
        name: str,
        owner: str,
        token: int,
        ttl: float,
        expires: float,
        lease: float,
        holder: dict[str, Any],
        renew: bool,
    ) -> HeldLock:
        self = object.__new__(cls)
        self.backend = backend
        self.name = name
        self.owner = owner
        self.token = int(token)
        self.ttl = ttl
        self.holder = holder
        self.lost_reason = None
        self._mutex = threading.Lock()
        self._state = _HELD
        # ``expires`` is when the lease ends at the earliest by our clock (for a
        # plain grant: when we sent the request, plus the TTL, since the
        # service started counting no earlier than that).
        self._expires = expires - backend.drift(lease)
        self._renew_enabled = renew
        self._watch_generation = 0
        self._fork_generation = _fork_generation
        self._renewing = False
        self._forgotten = None
        if renew and backend.supports_shared_leases:
            # Renewing this process's other leases would keep this one alive
            # after the handle is dropped; the finalizer ends it on time.
            self._expiry_cell = [self._expires]
            self._forgotten = weakref.finalize(
                self, _release_forgotten, backend, name, owner, self._expiry_cell, _fork_generation
            )
            self._forgotten.atexit = False
        if renew:
            get_watchdog().schedule(self, min(ttl, lease) / 3)
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
                )
            except BaseException:
                self._release_quietly()
                raise
        return self

    def __repr__(self) -> str:
        return (
            f"<HeldLock {self.name!r} token={self.token} backend={self.alias!r} "
            f"state={self._state}>"
        )

    @property
    def alias(self) -> str:
        return self.backend.alias

    @property
    def released(self) -> bool:
        return self._state == _RELEASED

    @property
    def detached(self) -> bool:
        """True once :meth:`detach` handed the lease to whoever adopts its ticket."""
        return self._state == _DETACHED

    @property
    def lost(self) -> bool:
        """True once the lease is known to be gone, or must have run out by our clock.

        Local knowledge only; :meth:`ensure` asks the lock service.
        """
        return self._state == _LOST or (self._state == _HELD and self.expires_in <= 0)

    @property
    def expires_in(self) -> float:
        """Seconds until the lease runs out by our conservative estimate, unless renewed."""
        return self._expires - time.monotonic()

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless the lock service confirms the lease is ours now.

        One round trip. The confirmation is for this instant: a write that
        follows should still carry :attr:`token`.
        """
        self._before_ensure()
        if not self.backend.do_check(self.name, self.owner):
            self._ensure_refused()

    def _inherited(self) -> bool:
        """This process was forked from the one that holds the lease."""
        return self._fork_generation != _fork_generation

    def _before_ensure(self) -> None:
        if self._inherited():
            raise self._error(LockLost, _INHERITED)
        if self._state in (_RELEASED, _DETACHED):
            raise self._error(LockLost, f"was {self._state}")
        if self._state == _LOST:
            raise self._error(LockLost, f"was lost: {self.lost_reason}")
        if self.expires_in <= 0:
            self._mark_lost("its lease ran out before it could be renewed")
            raise self._error(LockLost, f"was lost: {self.lost_reason}")

    def _ensure_refused(self) -> None:
        self._mark_lost("the lock service no longer has this lease (expired or broken)")
        raise self._error(LockLost, f"was lost: {self.lost_reason}")

    def extend(self, ttl: float | None = None) -> None:
        """Make the lease run ``ttl`` seconds from now (default: its current TTL).

        The new TTL also becomes the renewal period's basis. Raises
        :class:`LockNotOwned` (a :class:`LockLost`) if the lease is gone.
        """
        ttl = self._before_extend(ttl)
        sent = time.monotonic()
        self._after_extend(self.backend.do_extend(self.name, self.owner, ttl), sent, ttl)

    def _before_extend(self, ttl: float | None) -> float:
        ttl = self.ttl if ttl is None else validate_ttl(ttl)
        if self._inherited():
            raise self._error(LockNotOwned, f"cannot be extended: it {_INHERITED}")
        if self._state != _HELD:
            raise self._error(LockNotOwned, f"cannot be extended: it was {self._state}")
        return ttl

    def _after_extend(self, extended: bool, sent: float, ttl: float) -> None:
        if not extended:
            self._mark_lost("extend was refused: the lease expired or was broken")
            raise self._error(LockNotOwned, "cannot be extended: the lease is gone")
        self._renewed(sent, ttl)

    def release(self) -> None:
        """Release the lease if this handle still owns it.

        Releasing twice, or after :meth:`detach`, is a no-op. Raises
        :class:`LockNotOwned` when the lease had already expired or been
        broken, since then the work done under it was not protected to the end.
        """
        was_lost = self._before_release()
        if was_lost is not None:
            self._after_release(self.backend.do_release(self.name, self.owner), was_lost)

    def _before_release(self) -> bool | None:
        """Mark the handle released; None if it already was (nothing to do), else was_lost.

        Also None in a process forked while the lease was held: the lease is
        the parent's, and leaving an inherited ``with`` block must not end it.
        """
        if self._inherited():
            return None
        with self._mutex:
            if self._state in (_RELEASED, _DETACHED):
                return None
            was_lost = self._state == _LOST
            self._state = _RELEASED
        # Stop renewing first: if the release cannot reach the service, the
        # lease must still run out rather than be kept alive by the watchdog.
        get_watchdog().cancel(self)
        self._remembered()
        return was_lost

    def _after_release(self, released: bool, was_lost: bool) -> None:
        if not released:
            if not was_lost:
                self.lost_reason = "release was refused: the lease expired or was broken"
                self._send_lost()
            raise self._error(
                LockNotOwned, "was not held at release: the lease expired or was broken"
            )
        if lock_released.receivers:
            lock_released.send(
                sender=type(self.backend),
                backend=self.alias,
                name=self.name,
                token=self.token,
                held=self,
            )

    # --- async: the backend's awaitable primitives (native, or a worker thread).

    async def aensure(self) -> None:
        """:meth:`ensure`, awaited."""
        self._before_ensure()
        if not await self.backend.ado_check(self.name, self.owner):
            self._ensure_refused()

    async def aextend(self, ttl: float | None = None) -> None:
        """:meth:`extend`, awaited."""
        ttl = self._before_extend(ttl)
        sent = time.monotonic()
        extended = await self.backend.ado_extend(self.name, self.owner, ttl)
        self._after_extend(extended, sent, ttl)

    async def arelease(self) -> None:
        """:meth:`release`, awaited."""
        was_lost = self._before_release()
        if was_lost is not None:
            self._after_release(await self.backend.ado_release(self.name, self.owner), was_lost)

    def detach(self) -> dict[str, Any]:
        """Hand the lease over: stop renewing it here and return a ticket for another process.

        The lease stays held on the lock service and runs out after its TTL
        unless ``locks[alias].adopt(ticket)`` (in any process, on a backend of
        the same settings) takes it up first. The ticket is JSON-serializable,
        so it can travel in a message: ``@locked_task(scope="queue")`` sends
        it with the task. This handle no longer owns the lease: releasing it
        is a no-op and :meth:`ensure` raises :class:`LockLost`.
        """
        if self._inherited():
            raise self._error(LockNotOwned, f"cannot be detached: it {_INHERITED}")
        with self._mutex:
            if self._state != _HELD:
                raise self._error(LockNotOwned, f"cannot be detached: it was {self._state}")
            self._state = _DETACHED
        get_watchdog().cancel(self)
        self._remembered()
        try:
            state = self.backend.do_detach(self.name, self.owner)
        except BaseException:
            with self._mutex:
                self._state = _HELD
            if self._renew_enabled:
                get_watchdog().schedule(self, 0)
            raise
        return {
            "v": TICKET_VERSION,
            "backend": self.alias,
            "name": self.name,
            "owner": self.owner,
            "token": self.token,
            "ttl": self.ttl,
            "holder": self.holder,
            "state": state,
        }

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        _release_on_exit(self, exc_type is not None)

    # --- internals -------------------------------------------------------------------

    def _error(self, cls: type[LockLost], what: str) -> LockLost:
        return cls(
            f"Lock {self.name!r} (token {self.token}) on backend {self.alias!r} {what}.",
            name=self.name,
            backend=self.alias,
        )

    def _release_quietly(self) -> None:
        try:
            self.release()
        except Exception:
            logger.exception("Could not release lock %r on %r", self.name, self.alias)

    async def _arelease_quietly(self) -> None:
        try:
            await self.arelease()
        except Exception:
            logger.exception("Could not release lock %r on %r", self.name, self.alias)

    def _mark_lost(self, reason: str) -> None:
        with self._mutex:
            if self._state != _HELD:
                return
            self._state = _LOST
            self.lost_reason = reason
        get_watchdog().cancel(self)
        self._remembered()
        self._send_lost()

    def _remembered(self) -> None:
        """The lease ended (or moved) through this handle: nothing to end when it is freed."""
        if self._forgotten is not None:
            self._forgotten.detach()

    def _send_lost(self) -> None:
        logger.warning(
            "Lock %r (token %s) on backend %r was lost: %s",
            self.name,
            self.token,
            self.alias,
            self.lost_reason,
        )
        for receiver, result in lock_lost.send_robust(
            sender=type(self.backend),
            backend=self.alias,
            name=self.name,
            token=self.token,
            held=self,
            reason=self.lost_reason,
        ):
            if isinstance(result, Exception):
                logger.error("lock_lost receiver %r raised %r", receiver, result)

    def _due(self) -> None:
        """The watchdog thread's turn: hand a renewal to the backend's thread, or judge one.

        It never waits on the lock service. When it sends a renewal it also
        schedules this handle again for the moment the lease runs out; if the
        renewal has not come back by then (a server that accepts and never
        answers, a database busy with another process's write), the lease is
        marked lost on time instead of whenever the call returns.
        """
        if self._state != _HELD:
            return
        if self._renewing:
            if self.expires_in <= 0:
                self._mark_lost("its renewal did not come back before the lease ran out")
            return
        self._renewing = True
        watchdog = get_watchdog()
        watchdog.schedule(self, max(self.expires_in, 0.0))
        watchdog.renewer(self.alias).submit(self._renew)

    def _renew(self) -> None:
        """Run on the backend's renewal thread; never raises."""
        try:
            if self._state != _HELD:
                return
            sent = time.monotonic()
            try:
                renewed = self.backend.do_extend(self.name, self.owner, self.ttl)
            except Exception as e:
                self._renewing = False
                remaining = self.expires_in
                if remaining <= 0:
                    self._mark_lost(f"renewal failed until the lease ran out: {e!r}")
                    return
                logger.warning(
                    "Renewing lock %r on %r failed, retrying: %r", self.name, self.alias, e
                )
                if self._state == _HELD:
                    delay = min(self.ttl * RETRY_FRACTION, remaining / 2, 1.0)
                    get_watchdog().schedule(self, delay)
                return
            self._renewing = False
            if not renewed:
                self._mark_lost("renewal was refused: the lease expired or was broken")
                return
            self._renewed(sent, self.ttl)
        finally:
            self._renewing = False

    def _renewed(self, sent: float, ttl: float) -> None:
        """The service granted ``ttl`` more seconds to a request sent at ``sent``."""
        with self._mutex:
            if self._state != _HELD:
                return
            self.ttl = ttl
            self._expires = sent + ttl - self.backend.drift(ttl)
            if self._forgotten is not None:
                self._expiry_cell[0] = self._expires
        if self._renew_enabled:
            get_watchdog().schedule(self, ttl / 3)


def _release_on_exit(held: HeldLock, body_raised: bool) -> None:
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


async def _arelease_on_exit(held: HeldLock, body_raised: bool) -> None:
    """``_release_on_exit``, awaited."""
    try:
        await held.arelease()
    except (LockLost, BackendUnavailable):
        if not body_raised:
            raise
        logger.warning("Releasing %r after an exception failed", held, exc_info=True)


def _release_forgotten(
    backend: Any, name: str, owner: str, expiry: list[float], generation: int
) -> None:
    """Finalizer of a held handle nobody references: release it when it would have run out."""
    if generation != _fork_generation:
        return  # freed in a forked child: the lease is the parent's

    def release() -> None:
        if backend.do_release(name, owner):
            logger.info("Released the lease of forgotten handle %r on %r", name, backend.alias)

    watchdog = get_watchdog()
    watchdog.call_at(expiry[0], lambda: watchdog.renewer(backend.alias).submit(release))


class _ReleaseAtCommit:
    """An ``on_commit`` callback that releases; freeing it uncalled (a rollback) releases too.

    Django drops the callbacks of a transaction, or of a savepoint, that rolls
    back; CPython frees the dropped callback at once (reference counting),
    and its finalizer releases the lock then. That happens inside Django's
    rollback, before the connection is back in autocommit, so for a backend
    whose statements run on Django's connections (the database backend) the
    finalizer hands the release to the backend's renewal thread, which uses
    a connection of its own.
    """

    def __init__(self, held: HeldLock) -> None:
        self.held = held
        self._finalizer = weakref.finalize(self, _release_elsewhere, held)
        self._finalizer.atexit = False

    def __call__(self) -> None:
        self._finalizer.detach()
        self.held._release_quietly()


def _release_elsewhere(held: HeldLock) -> None:
    if held.backend.uses_django_connections:
        get_watchdog().renewer(held.alias).submit(held._release_quietly)
    else:
        held._release_quietly()


def release_at_transaction_end(
    held: HeldLock, using: str | None = None, *, body_raised: bool = True
) -> bool:
    """Release ``held`` when the transaction of ``using`` ends; False if none is open.

    Unless ``body_raised``, the lease is confirmed first, as a release would:
    ``LockLost`` if it was lost inside the block, so that the transaction,
    whose work was not protected to the end, can roll back.
    """
    from django.db import DEFAULT_DB_ALIAS, transaction

    db = using or DEFAULT_DB_ALIAS
    connection = transaction.get_connection(db)
    if not connection.in_atomic_block or all(
        # Django's TestCase wraps each test in transactions that never commit:
        # code with no atomic() of its own releases at once, as in production.
        getattr(block, "_from_testcase", False)
        for block in connection.atomic_blocks
    ):
        return False
    if not body_raised:
        try:
            held.ensure()
        except LockLost:
            held._release_quietly()
            raise
    transaction.on_commit(_ReleaseAtCommit(held), using=db)
    return True


# What each Lock acquired in this context (thread or asyncio task), innermost last.
# Weak references: the Lock object keeps its own handles alive, so dropping the
# Lock (and the handle) lets the watchdog stop renewing and the lease expire.
_acquired: ContextVar[tuple[tuple[weakref.ref[Lock], weakref.ref[HeldLock]], ...]] = ContextVar(
    "django_dlock_acquired", default=()
)


class Lock:
    """A distributed lock on ``name``: what to acquire, not an acquisition.

    ``ttl``: lease length in seconds (default: the backend's ``TTL``, 30 s).
    ``timeout``: None waits forever, 0 tries once, otherwise seconds to wait
    before :class:`~django_dlock.LockTimeout`. ``backend``: the alias in
    ``DLOCK_BACKENDS``. ``metadata``: extra JSON-serializable holder details
    shown by ``manage.py locks``. ``renew``: let the watchdog renew the lease.
    ``release_on_commit``: leaving the block inside ``transaction.atomic()``
    (of database ``using``, default "default") keeps the lock until that
    transaction commits or rolls back, so that nobody reads what the block
    wrote before it is committed.

    Use it as ``with lock(...) as held:``, ``async with``, as a decorator, or
    call :meth:`acquire` by hand. As a decorator, ``name`` may be a template
    over the function's arguments: ``@lock("invoice:{invoice_id}")``.
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        backend: str = conf.DEFAULT_ALIAS,
        metadata: Mapping[str, Any] | None = None,
        renew: bool = True,
        release_on_commit: bool = False,
        using: str | None = None,
    ) -> None:
        self.name = validate_name(name)
        self.ttl = None if ttl is None else validate_ttl(ttl)
        self.timeout = validate_timeout(timeout)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be an alias (str), not {type(backend).__name__}.")
        self.backend = backend
        if metadata is not None:
            if not isinstance(metadata, Mapping):
                raise TypeError("metadata must be a dict.")
            dump_holder(metadata)
        self.metadata = dict(metadata) if metadata else None
        self.renew = renew
        if not isinstance(release_on_commit, bool):
            raise TypeError(f"release_on_commit must be True or False, not {release_on_commit!r}.")
        if using is not None and not isinstance(using, str):
            raise TypeError(f"using must be a DATABASES alias (str), not {type(using).__name__}.")
        self.release_on_commit = release_on_commit
        self.using = using
        self._handles: set[HeldLock] = set()

    def __repr__(self) -> str:
        return f"<Lock {self.name!r} backend={self.backend!r}>"

    def acquire(self, timeout: float | None = _UNSET, *, name: str | None = None) -> HeldLock:
        """Acquire and return the handle; ``timeout`` overrides the one given to ``lock()``.

        The handle is also remembered, so :meth:`release` (or leaving a
        ``with`` block) on this object releases the latest acquisition made in
        the current thread or task.
        """
        held = self._acquire(timeout, name)
        self._push(held)
        return held

    def release(self) -> None:
        """Release the latest acquisition of this object in the current thread or task.

        With ``release_on_commit`` inside ``atomic()``: when the transaction ends.
        """
        held = self._pop()
        if not self._release_at_commit(held):
            held.release()

    async def aacquire(
        self, timeout: float | None = _UNSET, *, name: str | None = None
    ) -> HeldLock:
        """:meth:`acquire`, awaited: the backend's awaitable primitives, no blocking call."""
        held = await self._aacquire(timeout, name)
        self._push(held)
        return held

    async def arelease(self) -> None:
        """:meth:`release`, awaited."""
        await self._pop().arelease()

    def __enter__(self) -> HeldLock:
        return self.acquire()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        held = self._pop()
        if not self._release_at_commit(held, exc_type is not None):
            _release_on_exit(held, exc_type is not None)

    async def __aenter__(self) -> HeldLock:
        return await self.aacquire()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await _arelease_on_exit(self._pop(), exc_type is not None)

    def __call__(self, func: F) -> F:
        """Decorate ``func`` so each call runs under the lock, the key built from its arguments."""
        template = KeyTemplate(self.name, inspect.signature(func), func.__qualname__)
        key_for = template.format

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                held = await self._aacquire(_UNSET, key_for(args, kwargs))
                try:
                    result = await func(*args, **kwargs)
                except BaseException:
                    await _arelease_on_exit(held, True)
                    raise
                await _arelease_on_exit(held, False)
                return result

            return cast(F, async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            held = self._acquire(_UNSET, key_for(args, kwargs))
            try:
                result = func(*args, **kwargs)
            except BaseException:
                if not self._release_at_commit(held, True):
                    _release_on_exit(held, True)
                raise
            if not self._release_at_commit(held):
                _release_on_exit(held, False)
            return result

        return cast(F, wrapper)

    # --- internals -------------------------------------------------------------------

    def _release_at_commit(self, held: HeldLock, body_raised: bool = False) -> bool:
        """With ``release_on_commit`` inside ``atomic()``: leave the release to its end."""
        if not self.release_on_commit:
            return False
        return release_at_transaction_end(held, self.using, body_raised=body_raised)

    def _acquire(self, timeout: float | None, name: str | None) -> HeldLock:
        # Everything but a templated key was validated when the Lock was made.
        return locks[self.backend]._acquire(*self._arguments(timeout, name))

    async def _aacquire(self, timeout: float | None, name: str | None) -> HeldLock:
        return await locks[self.backend]._aacquire(*self._arguments(timeout, name))

    def _arguments(
        self, timeout: float | None, name: str | None
    ) -> tuple[str, float | None, float | None, Mapping[str, Any] | None, bool]:
        return (
            self.name if name is None else validate_name(name),
            self.ttl,
            self.timeout if timeout is _UNSET else validate_timeout(timeout),
            self.metadata,
            self.renew,
        )

    def _push(self, held: HeldLock) -> None:
        # Handles released or detached directly (``h.release()`` rather than
        # ``lock.release()``) are dropped here, so that a long-lived Lock
        # keeps only what may still be popped; the stack keeps weak references.
        handles = self._handles
        ended = [h for h in handles if h._state in (_RELEASED, _DETACHED)]
        handles.difference_update(ended)
        handles.add(held)
        live = tuple(
            entry for entry in _acquired.get() if entry[0]() is not None and entry[1]() is not None
        )
        _acquired.set((*live, (weakref.ref(self), weakref.ref(held))))

    def _pop(self) -> HeldLock:
        stack = _acquired.get()
        for i in range(len(stack) - 1, -1, -1):
            held = stack[i][1]()
            if stack[i][0]() is self and held is not None:
                _acquired.set(stack[:i] + stack[i + 1 :])
                self._handles.discard(held)
                return held
        raise RuntimeError(f"{self!r} was not acquired in this thread or task.")


#: ``lock(name, ttl=..., timeout=..., backend=..., metadata=..., renew=...,
#: release_on_commit=..., using=...)``
lock = Lock
