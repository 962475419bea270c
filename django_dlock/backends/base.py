"""The backend contract.

The base class owns everything that must behave the same on every backend:
validating settings, owner tokens, deadlines on ``time.monotonic()``, the
blocking loop, holder metadata, signals and the watchdog (through
:class:`~django_dlock.lock.HeldLock`). A backend implements only atomic,
single-attempt primitives, as redis-py's ``Lock.acquire`` delegates to
``do_acquire``:

``do_acquire(name, owner, ttl, holder, renew=True)``
    One atomic attempt. If the lock is free or its lease has expired by the
    service's clock, grant it to ``owner`` for ``ttl`` seconds, advance the
    per-name fencing counter and store ``holder`` (JSON text); return the new
    fencing token. Otherwise return None. A backend that learns of a lease
    granted some other way (handed over by the previous holder, or found on a
    retry) returns a :class:`Grant` saying when that lease ends. ``renew``
    says whether the watchdog will renew the lease; a backend whose leases
    are shared between locks (etcd) gives one that will not be renewed a
    lease of its own, so that it still ends after ``ttl``.
``do_release(name, owner)`` / ``do_extend(name, owner, ttl)`` / ``do_check(name, owner)``
    Compare the owner on the server, atomically with the change; return
    whether ``owner`` held a live lease.
``do_break(name, token)``
    Delete the live lease whoever holds it, or only if its fencing token is
    ``token`` when that is not None; return whether a lease was deleted.
``do_list(prefix)``
    The live leases whose names start with ``prefix``.
``do_get(name)``
    The live lease on exactly ``name`` (a :class:`LockInfo`, as ``do_list``
    gives it), or None; one lookup, not a listing by prefix.
``ado_acquire`` / ``ado_release`` / ``ado_extend`` / ``ado_check`` / ``ado_abandon`` / ``await_``
    The same, awaitable, for the async API. The defaults run the sync
    primitive in a worker thread; a backend that sets ``native_async`` talks
    to the service from the event loop (Redis on one server).
``do_ping()``
    One round trip to the service; return its name and version
    (``"Redis 7.0.15"``) and warnings about parts of it that did not answer
    although locking still works (a Redlock master). Raise
    ``BackendUnavailable`` if it cannot lock.
``wait(name, owner, remaining, attempt)``
    Block until the lock may have become free, at most ``remaining`` seconds.
    The default backs off with jitter; backends that can be woken override it.
``do_abandon(name, owner)``
    The waiter ``owner`` gives up (timeout or error): leave any queue it
    joined. The default does nothing.
``do_detach(name, owner)`` / ``do_adopt(name, owner, new_owner, ttl, state)``
    Hand a held lease to another process: ``do_detach`` forgets it here
    without releasing it and returns what another process needs to keep it
    (JSON-serializable; the default: nothing, the owner token is enough).
    ``do_adopt`` moves the live lease of ``owner`` to ``new_owner`` and makes
    it run ``ttl`` seconds from now, in one atomic step on the service;
    it returns False if ``owner`` no longer holds it (it ran out, was broken,
    or was adopted already), so that one ticket is adopted at most once.
``do_release_ticket(name, owner, state)``
    Release a handed-over lease that nobody adopted; owner-checked like
    ``do_release`` (the default calls it), so it is False once adopted.

Capabilities are declared as attributes (``supports_fair``,
``supports_wakeups``, ``supports_multiprocess``, ``supports_shared_leases``),
and the conformance suite skips, with the reason, what a backend declares it
cannot do.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from operator import attrgetter
from typing import Any, ClassVar

from django.core.checks import CheckMessage

from .. import conf
from .._validation import (
    holder_metadata,
    new_owner,
    validate_name,
    validate_timeout,
    validate_ttl,
)
from ..exceptions import (
    BackendUnavailable,
    InvalidLockOption,
    InvalidTTL,
    LockConfigurationError,
    LockNotOwned,
    LockTimeout,
)
from ..lock import TICKET_VERSION, HeldLock, Lock
from ..signals import lock_broken

logger = logging.getLogger("django_dlock")

#: Backoff of the default ``wait()``: first sleep, growth factor and ceiling (seconds).
BACKOFF_FIRST = 0.002
BACKOFF_FACTOR = 2.0
BACKOFF_CEILING = 0.1


def backoff(attempt: int, ceiling: float = BACKOFF_CEILING) -> float:
    """The jittered sleep before retry ``attempt`` (0, 1, ...): doubling up to ``ceiling``.

    The exponent stops growing long after any ceiling is reached: ``2.0 **
    1024`` overflows a float, which a waiter reached after about 77 s of 0.1 s
    sleeps.
    """
    ceiling = min(ceiling, BACKOFF_FIRST * BACKOFF_FACTOR ** min(attempt, _MAX_DOUBLINGS))
    return random.uniform(ceiling / 2, ceiling)


def outage_backoff(retry: int) -> float:
    """The jittered sleep before retry ``retry`` while the service is down.

    The waiting backoff, growing on to OUTAGE_BACKOFF_CEILING: many waiters
    must not reconnect ten times a second each to a server that is coming
    back up (each retry may also release its unknown attempt).
    """
    return backoff(retry, OUTAGE_BACKOFF_CEILING)


#: Longest sleep between retries while the lock service is down, seconds.
OUTAGE_BACKOFF_CEILING = 1.0
# More doublings than any ceiling needs (0.002 * 2**64 is about 3.7e16 s).
_MAX_DOUBLINGS = 64

#: An acquire with no timeout that rides out an outage says so this often (seconds).
OUTAGE_LOG_EVERY = 30.0


@dataclass(frozen=True)
class Grant:
    """A lease whose start the backend knows better than "when the attempt was sent".

    ``expires`` is a ``time.monotonic()`` instant no later than the lease's
    end, and ``lease`` its length in seconds (it may be shorter than the TTL
    asked for; the watchdog then extends it).
    """

    token: int
    expires: float
    lease: float


@dataclass(frozen=True)
class LockInfo:
    """One live lease, as listed by ``locks[alias].list()``.

    ``acquired_at`` and ``expires_at`` come from the lock service's clock;
    ``expires_in`` is the seconds left by that clock when the list was taken.
    ``_holder_json`` is the stored text ``holder`` was parsed from, when the
    backend has it: ``manage.py locks --json`` copies it instead of encoding
    ``holder`` again.
    """

    backend: str
    name: str
    token: int
    holder: dict[str, Any] = field(hash=False)
    acquired_at: datetime
    expires_at: datetime
    expires_in: float
    _holder_json: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ServerStatus:
    """What ``locks[alias].ping()`` found: the service answered in ``latency`` seconds.

    ``warnings`` name the parts of it that did not answer although it can
    still lock (a Redlock master that is down).
    """

    backend: str
    version: str
    latency: float
    warnings: tuple[str, ...] = ()


class BaseLockBackend:
    """Settings, the blocking loop and the public backend API; see the module docstring."""

    #: Are waiters served in the order they first asked? A backend where an
    #: option decides (Redis's ``OPTIONS={"fair": True}``) sets it per
    #: instance, so it is not a ClassVar.
    supports_fair: bool = False
    #: Does a release wake waiters (no backoff sleep between attempts)?
    supports_wakeups: ClassVar[bool] = False
    #: Do processes on one machine (or several) see the same locks?
    supports_multiprocess: ClassVar[bool] = True
    #: Shortest lease the service grants, in seconds. A shorter TTL is rounded
    #: up: the lease lasts longer than asked, never shorter (etcd: 1 s).
    min_ttl: ClassVar[float] = 0.001
    #: How late after its end the service may still be deleting an expired
    #: lease, in seconds (etcd's leader looks for expired leases every 0.5 s).
    expiry_slack: ClassVar[float] = 0.0
    #: Do held leases share one lease on the service, so that renewing one
    #: keeps them all alive (etcd's session lease)? Then a forgotten handle's
    #: lease is released by the watchdog when it would have run out.
    supports_shared_leases: ClassVar[bool] = False
    #: Do its statements run on Django's database connections (which a
    #: rollback is still resetting when the callbacks it drops are freed)?
    uses_django_connections: ClassVar[bool] = False
    #: ``OPTIONS`` keys this backend accepts; anything else is an error.
    allowed_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        self.alias = alias
        self.path = f"{type(self).__module__}.{type(self).__qualname__}"
        unknown = sorted(set(params) - conf.SETTINGS_KEYS)
        if unknown:
            raise InvalidLockOption(
                f"Unknown settings {unknown!r} for lock backend {alias!r} ({self.path}); "
                f"the keys are {sorted(conf.SETTINGS_KEYS)!r}.",
                alias=alias,
            )
        try:
            self.default_ttl = validate_ttl(params.get("TTL", conf.DEFAULT_TTL), what="TTL")
        except (TypeError, ValueError) as e:
            raise InvalidTTL(f"Lock backend {alias!r}: {e}", alias=alias) from e
        self.location = params.get("LOCATION")
        self.key_prefix = params.get("KEY_PREFIX", "") or ""
        try:
            validate_name(self.key_prefix, what="KEY_PREFIX")
        except (TypeError, ValueError) as e:
            raise LockConfigurationError(f"Lock backend {alias!r}: {e}", alias=alias) from e
        options = params.get("OPTIONS")
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise LockConfigurationError(
                f"OPTIONS of lock backend {alias!r} must be a dict.", alias=alias
            )
        unknown = sorted(set(options) - self.allowed_options)
        if unknown:
            accepted = sorted(self.allowed_options) or "none"
            raise InvalidLockOption(
                f"Unknown OPTIONS {unknown!r} for lock backend {alias!r} ({self.path}); "
                f"it accepts: {accepted}.",
                alias=alias,
            )
        self.options = dict(options)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} alias={self.alias!r}>"

    # --- settings helpers for backends ------------------------------------------------

    def _config_error(self, message: str) -> LockConfigurationError:
        """A settings error that names this alias (``manage.py check`` shows E006)."""
        return LockConfigurationError(f"Lock backend {self.alias!r}: {message}", alias=self.alias)

    def _bool_option(self, key: str) -> bool:
        value = self.options.get(key, False)
        if not isinstance(value, bool):
            raise self._config_error(f"OPTIONS[{key!r}] must be True or False.")
        return value

    def _number_option(self, key: str, default: float) -> float:
        value = self.options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self._config_error(f"OPTIONS[{key!r}] must be a positive number.")
        return float(value)

    # --- primitives -----------------------------------------------------------------

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        raise NotImplementedError

    def do_release(self, name: str, owner: str) -> bool:
        raise NotImplementedError

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        raise NotImplementedError

    def do_check(self, name: str, owner: str) -> bool:
        raise NotImplementedError

    def do_break(self, name: str, token: int | None) -> bool:
        raise NotImplementedError

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        raise NotImplementedError

    def do_list(self, prefix: str) -> list[LockInfo]:
        raise NotImplementedError

    def do_get(self, name: str) -> LockInfo | None:
        raise NotImplementedError

    def do_abandon(self, name: str, owner: str) -> None:
        """Leave whatever queue ``owner`` joined while waiting for ``name``."""

    def do_detach(self, name: str, owner: str) -> Any:
        """Forget ``owner``'s lease here without releasing it; return what adopting needs."""
        return None

    def do_adopt(self, name: str, owner: str, new_owner: str, ttl: float, state: Any) -> bool:
        raise NotImplementedError

    def do_release_ticket(self, name: str, owner: str, state: Any) -> bool:
        """Release a lease ``do_detach`` handed over, if ``owner`` still holds it."""
        return self.do_release(name, owner)

    def wait(self, name: str, owner: str, remaining: float | None, attempt: int) -> None:
        """Sleep an exponentially growing, jittered interval, never past the deadline."""
        delay = backoff(attempt)
        time.sleep(delay if remaining is None else min(delay, remaining))

    def check(self) -> list[CheckMessage]:
        """Backend-specific system check messages (static: no network)."""
        return []

    def close(self) -> None:
        """Release client resources; held leases are left to expire or be released."""

    # --- awaitable primitives: release, extend and check in a worker thread
    # unless the backend has native ones.

    #: The awaitable primitives talk to the service from the event loop
    #: itself; otherwise an async acquire runs the sync one in a worker thread.
    #: (An instance attribute: for Redis it depends on the settings.)
    native_async: bool = False

    async def ado_release(self, name: str, owner: str) -> bool:
        return await asyncio.to_thread(self.do_release, name, owner)

    async def ado_extend(self, name: str, owner: str, ttl: float) -> bool:
        return await asyncio.to_thread(self.do_extend, name, owner, ttl)

    async def ado_check(self, name: str, owner: str) -> bool:
        return await asyncio.to_thread(self.do_check, name, owner)

    # With native_async, _aacquire drives the acquire loop with these; a
    # backend that sets it provides all three (the sync loop's per-thread
    # state would not survive one worker thread per call).

    async def ado_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        raise NotImplementedError

    async def ado_abandon(self, name: str, owner: str) -> None:
        raise NotImplementedError

    async def await_(self, name: str, owner: str, remaining: float | None, attempt: int) -> None:
        raise NotImplementedError

    # --- public API -----------------------------------------------------------------

    def acquire(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        renew: bool = True,
    ) -> HeldLock:
        """Acquire ``name``, waiting up to ``timeout`` seconds (None: forever, 0: one try).

        Raises :class:`~django_dlock.LockTimeout` when the deadline passes first.
        While the lock service is unavailable the attempt is retried with
        backoff until the deadline, and then the last
        :class:`~django_dlock.BackendUnavailable` is raised; ``timeout=0``
        fails fast, and errors no retry can fix (a wrong password) are raised
        at once.
        """
        return self._acquire(
            validate_name(name),
            None if ttl is None else validate_ttl(ttl),
            validate_timeout(timeout),
            metadata,
            renew,
        )

    def _acquisition(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: tuple[dict[str, Any], str],
        timeout: float | None,
        deadline: float | None,
        renew: bool,
        refused: bool,
    ) -> Generator[tuple[str, tuple[Any, ...], dict[str, Any]], Any, HeldLock]:
        """The blocking loop of ``acquire()``, without its I/O.

        It yields ``(primitive, args, kwargs)`` for each call to the lock service
        ("acquire", "wait", "abandon", "release") and for a pause ("sleep"),
        and is sent each call's result or thrown its exception. ``_acquire``
        drives it with the sync primitives once its first attempt was refused
        (``refused``) or failed, and ``_aacquire`` with the awaitable ones from
        the start, so both share one loop.

        An outage is ridden out: a :class:`BackendUnavailable` from a call is
        retried after a backoff sleep until the deadline, and then raised
        (not ``LockTimeout``: the caller should learn the service was down),
        unless it is not ``transient`` (a wrong password), which is raised at
        once. ``timeout=0`` has no time to retry in. With no deadline the
        outage is logged as a warning when it starts and every OUTAGE_LOG_EVERY
        seconds while it lasts, so that a waiter hanging on it shows.
        """
        attempt = 0
        # True while an attempt is out whose outcome we may never learn: sent,
        # then a timeout, a lost connection or a cancelled task. The service
        # may have granted it; nobody would hold that lease until its TTL ran
        # out, so it is released (owner-checked) before the next attempt or on
        # the way out.
        unknown = False
        # The outage being ridden out: its latest error, when it began, how
        # many backoff sleeps it has had, and when it was last logged.
        failure: BackendUnavailable | None = None
        down_since = 0.0
        logged: float | None = None
        retries = 0
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0 and (refused or failure):
                    if failure is None:
                        raise LockTimeout(
                            f"Could not acquire lock {name!r} on backend {self.alias!r} "
                            f"within {timeout:g}s.",
                            name=name,
                            backend=self.alias,
                        )
                    if not retries:
                        raise failure  # no time to retry in (timeout=0)
                    raise BackendUnavailable(
                        f"{failure} (retried for {time.monotonic() - down_since:.1f}s, until "
                        f"the acquire timeout of {timeout:g}s ran out)",
                        name=failure.name or name,
                        backend=failure.backend or self.alias,
                    ) from failure
                try:
                    if failure is not None:
                        delay = outage_backoff(retries)
                        yield (
                            "sleep",
                            (delay if remaining is None else min(delay, remaining),),
                            {},
                        )
                        retries += 1
                        if unknown:
                            # The failed attempt may have been granted. Were it
                            # left, the next attempt would wait for our own
                            # lease (the database refuses an owner's second
                            # attempt), so it goes first; if the service is
                            # still down this fails, and is tried again.
                            yield ("abandon", (name, owner), {})
                            yield ("release", (name, owner), {})
                            unknown = False
                    elif refused:
                        yield ("wait", (name, owner, remaining, attempt), {})
                        attempt += 1
                    sent = time.monotonic()
                    unknown = True
                    result = yield ("acquire", (name, owner, ttl, holder[1]), {"renew": renew})
                    unknown = False
                except BackendUnavailable as e:
                    if not e.transient:
                        raise
                    now = time.monotonic()
                    if failure is None:
                        down_since = now
                    if deadline is None and (logged is None or now - logged >= OUTAGE_LOG_EVERY):
                        logged = now
                        logger.warning(
                            "Lock backend %r unavailable for %.0fs while acquiring %r; "
                            "retrying until it answers (no timeout): %s",
                            self.alias,
                            now - down_since,
                            name,
                            e,
                        )
                    failure = e
                    continue
                if failure is not None:
                    if logged is not None:
                        logger.info(
                            "Lock backend %r answers again after %.1fs; acquiring %r goes on",
                            self.alias,
                            time.monotonic() - down_since,
                            name,
                        )
                    failure, retries, logged = None, 0, None
                if result is not None:
                    if not self._arrived_late(name, result, sent, ttl):
                        try:
                            held = self._handle_for(
                                name, owner, ttl, holder[0], renew, result, sent
                            )
                        except LockNotOwned:
                            # A short first lease (a hand-over) ran out before
                            # it could be extended to the TTL: not ours after
                            # all, so wait again (the holder that follows
                            # counts as refusing us).
                            result = None
                            refused = True
                            continue
                        break
                    # Granted, but the reply came after the lease ran out by
                    # our clock: someone else may hold the lock by now. Give
                    # it back (owner-checked) and go on as if refused.
                    try:
                        yield ("release", (name, owner), {})
                    except Exception:
                        logger.debug("Could not release a late grant of %r", name)
                    result = None
                refused = True
        except BaseException as e:
            # An error that says the attempt took no effect is not unknown.
            # Nor is one the service refuses every time (a wrong password,
            # a TTL out of range): it was refused, not lost on the way.
            known = getattr(e, "outcome_known", False) or getattr(e, "transient", True) is False
            unknown = unknown and not known
            for step, needed in (("abandon", refused or unknown), ("release", unknown)):
                if not needed:
                    continue
                try:
                    yield (step, (name, owner), {})
                except Exception:
                    # The lease or queue entry expires on its own; the caller's
                    # error matters more.
                    logger.warning("Could not %s the attempt on %r on %r", step, name, self.alias)
            raise
        return held

    def _arrived_late(self, name: str, result: int | Grant, sent: float, ttl: float) -> bool:
        """Did the grant's reply come after its lease had run out by our clock?

        A reply held up by the network longer than the TTL (the chaos run's
        black hole) grants a lease that is gone: handing it to the caller
        would let two holders believe they hold the lock.
        """
        if isinstance(result, Grant):
            expires, lease = result.expires, result.lease
        else:
            expires, lease = sent + ttl, ttl
        if expires - self.drift(lease) > time.monotonic():
            return False
        logger.warning(
            "A grant of %r on %r came back after its lease had run out; trying again",
            name,
            self.alias,
        )
        return True

    def _handle_for(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: dict[str, Any],
        renew: bool,
        result: int | Grant,
        sent: float,
    ) -> HeldLock:
        """The handle for a granted attempt sent at ``sent``."""
        if isinstance(result, Grant):
            token, expires, lease = result.token, result.expires, result.lease
        else:
            token, expires, lease = result, sent + ttl, ttl
        return HeldLock._granted(self, name, owner, token, ttl, expires, lease, holder, renew)

    def _acquire(
        self,
        name: str,
        ttl: float | None,
        timeout: float | None,
        metadata: Mapping[str, Any] | None,
        renew: bool,
    ) -> HeldLock:
        """``acquire()`` with arguments already validated (``Lock`` checks them once)."""
        if ttl is None:
            ttl = self.default_ttl
        owner = new_owner()
        holder = holder_metadata(ttl, metadata)
        deadline = None if timeout is None else time.monotonic() + timeout
        sent = time.monotonic()
        try:
            result = self.do_acquire(name, owner, ttl, holder[1], renew=renew)
        except BaseException as e:
            # Its outcome is unknown: the loop, at this same attempt, gives it up.
            steps = self._acquisition(name, owner, ttl, holder, timeout, deadline, renew, False)
            next(steps)
            return self._drive(steps, e)
        if result is not None:  # the uncontended case: no loop to drive
            if not self._arrived_late(name, result, sent, ttl):
                try:
                    return self._handle_for(name, owner, ttl, holder[0], renew, result, sent)
                except LockNotOwned:
                    pass  # its short first lease ran out: wait, as in _acquisition
            else:
                try:
                    self.do_release(name, owner)  # as in _acquisition
                except Exception:
                    logger.debug("Could not release a late grant of %r", name)
        steps = self._acquisition(name, owner, ttl, holder, timeout, deadline, renew, True)
        return self._drive(steps, None, next(steps))

    def _drive(
        self,
        steps: Generator[tuple[str, tuple[Any, ...], dict[str, Any]], Any, HeldLock],
        error: BaseException | None,
        step: Any = None,
    ) -> HeldLock:
        """Run the acquire loop on the sync primitives, from ``step`` or by throwing ``error``."""
        primitives: dict[str, Callable[..., Any]] = {
            "acquire": self.do_acquire,
            "wait": self.wait,
            "abandon": self.do_abandon,
            "release": self.do_release,
            "sleep": time.sleep,
        }
        done = False
        if error is not None:
            done, step = _advance(steps, error=error)
        while not done:
            kind, args, kwargs = step
            try:
                result = primitives[kind](*args, **kwargs)
            except BaseException as e:
                done, step = _advance(steps, error=e)
            else:
                done, step = _advance(steps, result)
        held: HeldLock = step
        return held

    async def _aacquire(
        self,
        name: str,
        ttl: float | None,
        timeout: float | None,
        metadata: Mapping[str, Any] | None,
        renew: bool,
    ) -> HeldLock:
        """``_acquire`` with the awaitable primitives (``ado_acquire``, ``await_``, ...)."""
        if not self.native_async:
            # One worker thread for the whole acquisition, as the sync
            # primitives keep a refused attempt's state per thread.
            handoff = _Handoff()

            def acquire() -> HeldLock:
                return handoff.deliver(self._acquire(name, ttl, timeout, metadata, renew))

            acquiring = asyncio.get_running_loop().run_in_executor(
                None, functools.partial(contextvars.copy_context().run, acquire)
            )
            try:
                return await asyncio.shield(acquiring)
            except asyncio.CancelledError:
                # The thread goes on, and may be granted the lock after the
                # caller stopped waiting: whoever comes second releases it.
                release = handoff.abandon()
                acquiring.add_done_callback(_release_unwanted if release else _retrieve_outcome)
                raise
        if ttl is None:
            ttl = self.default_ttl
        deadline = None if timeout is None else time.monotonic() + timeout
        holder = holder_metadata(ttl, metadata)
        steps = self._acquisition(name, new_owner(), ttl, holder, timeout, deadline, renew, False)
        primitives: dict[str, Callable[..., Awaitable[Any]]] = {
            "acquire": self.ado_acquire,
            "wait": self.await_,
            "abandon": self.ado_abandon,
            "release": self.ado_release,
            "sleep": asyncio.sleep,
        }
        step: Any
        done, step = False, next(steps)
        while not done:
            kind, args, kwargs = step
            try:
                result = await primitives[kind](*args, **kwargs)
                if kind in ("acquire", "wait") and _cancelling():
                    # redis-py's asyncio BLPOP can swallow a cancellation
                    # (redis/redis-py#2028): honour it here.
                    raise asyncio.CancelledError
            except BaseException as e:
                done, step = _advance(steps, error=e)
            else:
                done, step = _advance(steps, result)
        held: HeldLock = step
        return held

    def adopt(
        self,
        ticket: Mapping[str, Any],
        *,
        ttl: float | None = None,
        renew: bool = True,
    ) -> HeldLock:
        """Take up a lease that :meth:`HeldLock.detach` handed over, in this or another process.

        The lease is confirmed on the lock service and made to run ``ttl``
        seconds from now (default: the TTL it was held with). Raises
        :class:`~django_dlock.LockNotOwned` if it ran out or was broken in the
        meantime, and ``ValueError`` for a ticket that is not one of ours or
        names another backend alias.
        """
        name, owner, token, held_ttl, holder, state = self._take_up(ticket)
        ttl = held_ttl if ttl is None else validate_ttl(ttl)
        adopter = new_owner()
        sent = time.monotonic()
        if not self.do_adopt(name, owner, adopter, ttl, state):
            raise LockNotOwned(
                f"Lock {name!r} (token {token}) on backend {self.alias!r} cannot be adopted: "
                "its lease ran out, was broken, or was adopted already.",
                name=name,
                backend=self.alias,
            )
        return HeldLock._granted(self, name, adopter, token, ttl, sent + ttl, ttl, holder, renew)

    def release_ticket(self, ticket: Mapping[str, Any]) -> bool:
        """Release a lease that :meth:`HeldLock.detach` handed over, without adopting it.

        For a handover that will not happen (the message carrying the ticket
        was not sent, or was revoked): one release, owner-checked on the lock
        service, instead of adopting and then releasing. False if the lease
        had run out, been broken or been adopted. Sends no signal: no handle
        held it here.
        """
        name, owner, _, _, _, state = self._take_up(ticket)
        return self.do_release_ticket(name, owner, state)

    def _take_up(
        self, ticket: Mapping[str, Any]
    ) -> tuple[str, str, int, float, dict[str, Any], Any]:
        """A ticket's name, owner, token, TTL, holder and backend state; ValueError if bad."""
        if not isinstance(ticket, Mapping) or ticket.get("v") != TICKET_VERSION:
            raise ValueError(f"Not a django-dlock lease ticket: {ticket!r}.")
        if ticket.get("backend") != self.alias:
            raise ValueError(
                f"The ticket is for lock backend {ticket.get('backend')!r}, not {self.alias!r}."
            )
        try:
            name = validate_name(ticket["name"])
            owner, token = ticket["owner"], int(ticket["token"])
            held_ttl = validate_ttl(ticket["ttl"])
            holder = dict(ticket.get("holder") or {})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Malformed django-dlock lease ticket {ticket!r}: {e}") from e
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"Malformed django-dlock lease ticket {ticket!r}: no owner.")
        return name, owner, token, held_ttl, holder, ticket.get("state")

    def drift(self, ttl: float) -> float:
        """Seconds of a ``ttl`` lease that a holder must not count on.

        The service's clock may run ahead of ours; a handle treats its lease
        as gone that much earlier. Redlock counts its masters' drift here.
        """
        return 0.0

    def lock(self, name: str, **kwargs: Any) -> Lock:
        """``lock(name, backend=<this alias>, **kwargs)``."""
        return Lock(name, backend=self.alias, **kwargs)

    def list(self, prefix: str = "") -> list[LockInfo]:
        """Live leases whose names start with ``prefix``, sorted by name."""
        prefix = validate_name(prefix, what="A lock name prefix")
        return sorted(self.do_list(prefix), key=attrgetter("name"))

    def get(self, name: str) -> LockInfo | None:
        """The live lease on ``name``, or None when nobody holds it; one lookup."""
        return self.do_get(validate_name(name))

    def break_lock(self, name: str, token: int | None = None) -> bool:
        """Delete the lease on ``name`` whoever holds it; False if nothing was held.

        With ``token``, delete it only if it is still the lease with that
        fencing token, in one atomic step on the server. An operator who
        decided to break the lease listed as token 7 must not break the
        holder who took the lock after 7 was released: t0 the list shows 7,
        t1 7 is released, t2 B acquires it as 8, t3 the break arrives and,
        with ``token=7``, leaves 8 alone.

        The former holder finds out at its next renewal or ``ensure()``
        (``LockLost``); work it does before then is unprotected, which is why
        writes should be fenced.
        """
        name = validate_name(name)
        if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
            raise TypeError(f"token must be an int or None, not {type(token).__name__}.")
        broken = self.do_break(name, token)
        if broken:
            lock_broken.send(sender=type(self), backend=self.alias, name=name, token=token)
        return broken

    def ping(self) -> ServerStatus:
        """One round trip to the lock service: its version and how long the trip took.

        Raises ``BackendUnavailable`` when the service does not answer.
        """
        started = time.monotonic()
        version, warnings = self.do_ping()
        return ServerStatus(self.alias, version, time.monotonic() - started, warnings)


class _Handoff:
    """Between an async acquire's worker thread and a caller that may stop waiting.

    Either the thread delivers the handle before the caller abandons it (then
    the caller's side releases it once the thread's result arrives), or the
    caller abandons first (then the thread releases what it gets).
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._abandoned = False
        self._delivered = False

    def deliver(self, held: HeldLock) -> HeldLock:
        with self._mutex:
            self._delivered = not self._abandoned
        if not self._delivered:
            held._release_quietly()
        return held

    def abandon(self) -> bool:
        """Mark the result unwanted; True if it was delivered already (the caller releases)."""
        with self._mutex:
            self._abandoned = True
            return self._delivered


def _cancelling() -> bool:
    """Whether the current task has a cancellation pending (Python 3.11+; else False)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


def _retrieve_outcome(acquiring: asyncio.Future[HeldLock]) -> None:
    """Take the thread's exception, if any, so asyncio does not report it as unseen."""
    if not acquiring.cancelled():
        acquiring.exception()


def _release_unwanted(acquiring: asyncio.Future[HeldLock]) -> None:
    """Release a delivered handle whose caller stopped waiting (off the event loop)."""
    if acquiring.cancelled() or acquiring.exception() is not None:
        return
    held = acquiring.result()
    threading.Thread(
        target=held._release_quietly, name="django-dlock-unwanted", daemon=True
    ).start()


def _advance(
    steps: Generator[Any, Any, Any], result: Any = None, error: BaseException | None = None
) -> tuple[bool, Any]:
    """Send ``result`` (or throw ``error``) into ``steps``: (finished, its value or next step)."""
    try:
        return False, (steps.throw(error) if error is not None else steps.send(result))
    except StopIteration as finished:
        return True, finished.value
