"""The backend contract: :class:`BaseLockBackend`, and its mutex primitives.

The base class owns everything that must behave the same on every backend:
validating settings, owner tokens, deadlines on ``time.monotonic()``, the
blocking loop (:class:`~.attempts.Attempt`), holder metadata, signals and the
watchdog (through :class:`~django_dlock.held.HeldLock`). A backend implements
only atomic, single-step primitives, as redis-py's ``Lock.acquire`` delegates
to ``do_acquire``: each is documented, with its rule, at its stub below;
``docs/development.md`` walks through writing one.

Two parts of the contract are opt-in, each a class of its own that a backend
derives from to declare it: semaphores and read/write locks
(:class:`~.semaphore_backend.SemaphoreBackend`, ``supports_semaphores``) and
the queues of parked Celery tasks (:class:`~.parking_backend.ParkingBackend`,
``supports_parking``). Other capabilities are declared as attributes
(``supports_fair``, ``supports_wakeups``, ``supports_multiprocess``,
``supports_shared_leases``), and the conformance suite skips, with the
reason, what a backend declares it cannot do.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import math
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any, ClassVar

from django.core.checks import CheckMessage

from .. import conf
from .._validation import (
    holder_metadata,
    load_holder,
    micros_to_datetime,
    new_owner,
    validate_name,
    validate_timeout,
    validate_ttl,
    without_internal,
)
from ..exceptions import (
    BackendUnavailable,
    InvalidLockOption,
    InvalidTTL,
    LockConfigurationError,
    LockNotOwned,
)
from ..held import HeldLock
from ..signals import lock_broken
from ..tickets import Ticket
from .attempts import Attempt
from .backoff import BACKOFF_CEILING, OUTAGE_BACKOFF_CEILING, backoff, outage_backoff
from .offload import Handoff, Offload, release_unwanted, retrieve_outcome
from .ops import MutexOps, SlotOps
from .probe import probe
from .types import (
    Grant,
    LockInfo,
    ParkedTask,
    SemaphoreInfo,
    ServerStatus,
    SlotEntry,
    extend_each,
)

# What a backend module needs, from one place (docs/development.md).
__all__ = [
    "BACKOFF_CEILING",
    "OUTAGE_BACKOFF_CEILING",
    "Attempt",
    "BackendUnavailable",
    "BaseLockBackend",
    "Grant",
    "LockInfo",
    "ParkedTask",
    "SemaphoreInfo",
    "ServerStatus",
    "SlotEntry",
    "backoff",
    "load_holder",
    "micros_to_datetime",
    "outage_backoff",
]

logger = logging.getLogger("django_dlock")


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
    #: The :class:`~.attempts.Attempt` one acquisition makes: its
    #: ``try_acquire()`` calls ``do_acquire``, its ``wait()`` backs off with
    #: jitter, its ``abandon()`` does nothing. A backend that wakes or queues
    #: waiters subclasses it and keeps what one acquisition learns there.
    attempt_class: ClassVar[type[Attempt]] = Attempt
    #: Does it keep semaphores and read/write locks? True on a
    #: :class:`~.semaphore_backend.SemaphoreBackend` (the ``*_slot`` primitives).
    supports_semaphores: ClassVar[bool] = False
    #: Does it keep queues of parked Celery tasks? True on a
    #: :class:`~.parking_backend.ParkingBackend`.
    supports_parking: ClassVar[bool] = False
    #: How many leases one ``do_extend_many`` call renews at most.
    renew_batch: ClassVar[int] = 50
    #: ``OPTIONS`` keys this backend accepts; anything else is an error.
    allowed_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        self.alias = alias
        #: The threads the async API runs blocking calls in (``offload.py``).
        self.offload = Offload(alias, close_connections=self.uses_django_connections)
        # Handles whose keys are equal are renewed together (one do_extend_many).
        self.renewal_key: Hashable = self
        # The dotted path as configured (``django_dlock.backends.etcd.EtcdBackend``),
        # not the module the class happens to be defined in.
        configured = params.get("BACKEND")
        self.path = (
            configured
            if isinstance(configured, str) and configured
            else f"{type(self).__module__}.{type(self).__qualname__}"
        )
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

    def config_error(self, message: str) -> LockConfigurationError:
        """A settings error that names this alias (``manage.py check`` shows E006)."""
        return LockConfigurationError(f"Lock backend {self.alias!r}: {message}", alias=self.alias)

    def _bool_option(self, key: str) -> bool:
        value = self.options.get(key, False)
        if not isinstance(value, bool):
            raise self.config_error(f"OPTIONS[{key!r}] must be True or False.")
        return value

    def _number_option(self, key: str, default: float) -> float:
        value = self.options.get(key, default)
        if not (type(value) in (int, float) and 0 < value < math.inf):  # inf, nan fail later
            raise self.config_error(f"OPTIONS[{key!r}] must be a positive, finite number.")
        return float(value)

    # --- the mutex primitives: each one atomic step on the service, by its clock ------

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        """One atomic attempt: grant ``name`` to ``owner`` if it is free or its lease ran out.

        Granted: a lease of ``ttl`` seconds, the name's fencing counter
        advanced (tokens never repeat, not even after the service lost its
        data) and ``holder`` (JSON text) stored; return the token. Refused:
        None. A lease learned of some other way (handed over by the previous
        holder, or found on a retry) is a :class:`Grant` saying when it ends.
        ``renew`` says whether the watchdog will renew it; a backend whose
        leases are shared (etcd) gives one that will not be a lease of its own.
        """
        raise NotImplementedError

    def do_release(self, name: str, owner: str) -> bool:
        """Delete ``owner``'s live lease on ``name``, owner-checked in the same step.

        Whether ``owner`` held a live lease.
        """
        raise NotImplementedError

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        """Make ``owner``'s live lease run ``ttl`` seconds from now, owner-checked.

        Whether ``owner`` held a live lease.
        """
        raise NotImplementedError

    def do_check(self, name: str, owner: str) -> bool:
        """Whether ``owner`` holds a live lease on ``name`` now (``held.ensure()``)."""
        raise NotImplementedError

    def do_extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]:
        """Renew up to ``renew_batch`` leases ``(name, owner, ttl)``: per lease, as ``do_extend``.

        Each lease's answer or its error. The default: one lease at a time.
        """
        return extend_each(self.do_extend, leases)

    def do_break(self, name: str, token: int | None) -> bool:
        """Delete the live lease on ``name`` whoever holds it; whether one went.

        With ``token``, only if the lease's fencing token is ``token``, in the
        same step.
        """
        raise NotImplementedError

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        """One round trip: the service and version (``"Redis 7.0.15"``) and warnings.

        Warnings name parts that did not answer although locking works (a
        Redlock master). Raise ``BackendUnavailable`` if it cannot lock.
        """
        raise NotImplementedError

    def do_list(self, prefix: str) -> list[LockInfo]:
        """The live leases whose names start with ``prefix``, in any order."""
        raise NotImplementedError

    def do_iter_list(self, prefix: str) -> Iterator[LockInfo]:
        """``do_list``, sorted by name, as an iterator (``manage.py locks --json``).

        The default sorts ``do_list``; a backend that reads its leases in name
        order a page at a time (Redis) yields them so, in a page's memory.
        """
        return iter(sorted(self.do_list(prefix), key=attrgetter("name")))

    def do_get(self, name: str) -> LockInfo | None:
        """The live lease on exactly ``name``, as ``do_list`` gives it, or None; one lookup."""
        raise NotImplementedError

    def do_detach(self, name: str, owner: str) -> Any:
        """Forget ``owner``'s lease here without releasing it; return what adopting needs.

        JSON-serializable; the default: nothing, the owner token is enough.
        """
        return None

    def do_adopt(self, name: str, owner: str, new_owner: str, ttl: float, state: Any) -> bool:
        """Move ``owner``'s live lease to ``new_owner``, running ``ttl`` from now, in one step.

        False if ``owner`` no longer holds it (it ran out, was broken or was
        adopted already): one ticket is adopted at most once.
        """
        raise NotImplementedError

    def do_release_ticket(self, name: str, owner: str, state: Any) -> bool:
        """Release a lease ``do_detach`` handed over, if ``owner`` still holds it.

        Owner-checked as ``do_release`` (the default calls it): False once adopted.
        """
        return self.do_release(name, owner)

    def check(self) -> list[CheckMessage]:
        """Backend-specific system check messages (static: no network)."""
        return []

    def close(self) -> None:
        """Release client resources; held leases are left to expire or be released."""

    # --- awaitable primitives: release, extend and check in a thread of the
    # backend's ``ops`` executor unless the backend has native ones.

    #: The awaitable primitives talk to the service from the event loop
    #: itself; otherwise the async API runs the sync ones in the backend's
    #: own threads (``offload.py``).
    #: (An instance attribute: for Redis it depends on the settings.)
    native_async: bool = False

    async def ado_release(self, name: str, owner: str) -> bool:
        """``do_release``, awaited: in a thread of the ``ops`` executor unless native."""
        return await asyncio.wrap_future(self.offload.submit("ops", self.do_release, name, owner))

    async def ado_extend(self, name: str, owner: str, ttl: float) -> bool:
        return await asyncio.wrap_future(
            self.offload.submit("ops", self.do_extend, name, owner, ttl)
        )

    async def ado_check(self, name: str, owner: str) -> bool:
        return await asyncio.wrap_future(self.offload.submit("ops", self.do_check, name, owner))

    # --- public API -----------------------------------------------------------------

    def acquire(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        renew: bool = True,
        limit: int | None = None,
        weight: int = 1,
        template: str | None = None,
    ) -> HeldLock:
        """Acquire ``name``, waiting up to ``timeout`` seconds (None: forever, 0: one try).

        Every lease enters here. ``limit=None`` is a mutex; otherwise a slot
        of ``weight`` in the semaphore of ``limit`` (``Semaphore`` and
        ``RWLock`` call this; a read/write lock is the semaphore of
        ``limits.RW_LIMIT``, a writer weighing all of it). ``limit`` on a
        backend without semaphores raises ``LockConfigurationError`` before
        any I/O. ``template`` is the key template ``name`` was made from, if
        any: what metrics and traces label the lease by (``HeldLock.template``).

        Raises :class:`~django_dlock.LockTimeout` when the deadline passes first.
        While the lock service is unavailable the attempt is retried with
        backoff until the deadline, and then the last
        :class:`~django_dlock.BackendUnavailable` is raised; ``timeout=0``
        fails fast, and errors no retry can fix (a wrong password) are raised
        at once.
        """
        _, attempt, timeout, deadline = self._begin(
            name, ttl, timeout, metadata, renew, limit, weight, template
        )
        return attempt.run(timeout, deadline)

    async def aacquire(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        renew: bool = True,
        limit: int | None = None,
        weight: int = 1,
        template: str | None = None,
    ) -> HeldLock:
        """:meth:`acquire`, awaited: with native async, no blocking call."""
        ops, attempt, timeout, deadline = self._begin(
            name, ttl, timeout, metadata, renew, limit, weight, template
        )
        if ops.native_async:
            return await attempt.arun(timeout, deadline)
        if attempt.waits_on_loop:
            # Tries in threads, waits on the event loop: no thread is held
            # while it waits (the database; Redis without native async).
            return await attempt.arun_on_loop(timeout, deadline)
        # The whole acquisition in a thread of the backend's ``waits``
        # executor (never the loop's default one, which the releases of
        # other code may need). If the caller stops waiting, the attempt
        # gives up at its next step (leaving any queue), and whoever comes
        # second (the thread or the caller) releases what it got.
        handoff = Handoff()

        def acquire() -> HeldLock:
            return handoff.deliver(attempt.run(timeout, deadline))

        acquiring = asyncio.wrap_future(self.offload.submit("waits", acquire))
        try:
            return await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            attempt.stop()
            release = handoff.abandon()
            acquiring.add_done_callback(release_unwanted if release else retrieve_outcome)
            raise

    def ops(self, limit: int | None = None, weight: int = 1) -> MutexOps | SlotOps:
        """The kind of lease ``limit`` and ``weight`` name on this backend (``ops.py``).

        Here, a mutex: a ``limit`` raises ``LockConfigurationError``, naming
        the alias, before any I/O. A :class:`~.semaphore_backend.SemaphoreBackend`
        gives a semaphore's slot for one.
        """
        if limit is not None:
            raise self._no_semaphores("limit=")
        if weight != 1 or isinstance(weight, bool):
            raise ValueError(f"weight={weight!r} needs a limit: a mutex has no weights.")
        return MutexOps(self)

    def _no_semaphores(self, what: str) -> LockConfigurationError:
        return LockConfigurationError(
            f"Lock backend {self.alias!r} ({self.path}) has no semaphores or read/write "
            f"locks: {what} needs a backend that has them (supports_semaphores).",
            alias=self.alias,
        )

    def _begin(
        self,
        name: str,
        ttl: float | None,
        timeout: float | None,
        metadata: Mapping[str, Any] | None,
        renew: bool,
        limit: int | None,
        weight: int,
        template: str | None,
    ) -> tuple[MutexOps | SlotOps, Attempt, float | None, float | None]:
        """The checked arguments' lease kind, its attempt and deadline; no I/O."""
        name = validate_name(name)
        ttl = self.default_ttl if ttl is None else validate_ttl(ttl)
        timeout = validate_timeout(timeout)
        ops = self.ops(limit, weight)
        if template is not None and not isinstance(template, str):
            raise TypeError(f"template must be a str or None, not {type(template).__name__}.")
        holder = holder_metadata(ttl, metadata)
        attempt = ops.attempt(name, new_owner(), ttl, holder, renew, template)
        # From the attempt's own start: the wait lock_timeout reports
        # (``waited``) then covers the whole timeout, not a little less.
        deadline = None if timeout is None else attempt.started + timeout
        return ops, attempt, timeout, deadline

    def adopt(
        self,
        ticket: Mapping[str, Any],
        *,
        ttl: float | None = None,
        renew: bool = True,
        template: str | None = None,
    ) -> HeldLock:
        """Take up a lease that :meth:`HeldLock.detach` handed over, in this or another process.

        The lease is confirmed on the lock service and made to run ``ttl``
        seconds from now (default: the TTL it was held with). Raises
        :class:`~django_dlock.LockNotOwned` if it ran out or was broken in the
        meantime, and ``ValueError`` for a ticket that is not one of ours or
        names another backend alias.
        """
        t = Ticket.parse(ticket, self.alias)
        ttl = t.ttl if ttl is None else validate_ttl(ttl)
        adopter = new_owner()
        sent = time.monotonic()
        if not self.do_adopt(t.name, t.owner, adopter, ttl, t.state):
            raise LockNotOwned(
                f"Lock {t.name!r} (token {t.token}) on backend {self.alias!r} cannot be "
                "adopted: its lease ran out, was broken, or was adopted already.",
                name=t.name,
                backend=self.alias,
            )
        return HeldLock(
            self, MutexOps(self), t.name, adopter, t.token,
            ttl=ttl, expires=sent + ttl, lease=ttl, holder=t.holder, renew=renew, adopted=True,
            template=template,
        )  # fmt: skip

    def release_ticket(self, ticket: Mapping[str, Any]) -> bool:
        """Release a lease that :meth:`HeldLock.detach` handed over, without adopting it.

        For a handover that will not happen (the message carrying the ticket
        was not sent, or was revoked): one release, owner-checked on the lock
        service, instead of adopting and then releasing. False if the lease
        had run out, been broken or been adopted. Sends no signal: no handle
        held it here.
        """
        t = Ticket.parse(ticket, self.alias)
        return self.do_release_ticket(t.name, t.owner, t.state)

    def drift(self, ttl: float) -> float:
        """Seconds of a ``ttl`` lease that a holder must not count on.

        The service's clock may run ahead of ours; a handle treats its lease
        as gone that much earlier. Redlock counts its masters' drift here.
        """
        return 0.0

    def session_end(self, owner: str) -> float:
        """The ``time.monotonic()`` instant after which ``owner``'s lease may be gone.

        Whatever its TTL: a ZooKeeper session ends its timeout after the
        service last heard from it, so a handle counts on no more than that
        (``HeldLock.expires_at``). ``math.inf``: leases end by their TTLs alone.
        """
        return math.inf

    def list(self, prefix: str = "") -> list[LockInfo]:
        """Live leases whose names start with ``prefix``, sorted by name."""
        prefix = validate_name(prefix, what="A lock name prefix")
        return sorted(without_internal(self.do_list(prefix), prefix), key=attrgetter("name"))

    def iter_list(self, prefix: str = "") -> Iterator[LockInfo]:
        """:meth:`list`, one lease at a time, in the same order.

        On a backend that reads its index a page at a time (Redis), memory
        stays that of a page. A lease that ends or starts while the pages are
        read may or may not be listed; no lease is listed twice. A backend that
        stops answering midway raises ``BackendUnavailable`` from the
        iteration, after the leases already given.
        """
        prefix = validate_name(prefix, what="A lock name prefix")
        return without_internal(self.do_iter_list(prefix), prefix)

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

    # --- semaphores: none here; a SemaphoreBackend overrides these -------------------

    def semaphores(self, prefix: str = "") -> builtins.list[SemaphoreInfo]:
        """Semaphores and read/write locks under ``prefix``: none on a backend without them.

        A :class:`~.semaphore_backend.SemaphoreBackend` lists them.
        """
        validate_name(prefix, what="A lock name prefix")
        return []

    def semaphore(self, name: str) -> SemaphoreInfo | None:
        """The semaphore or read/write lock ``name``: None on a backend without them."""
        validate_name(name)
        return None

    def break_slot(self, name: str, token: int | None = None) -> int:
        """Free a semaphore's slot; a backend without semaphores has none to free."""
        validate_name(name)
        raise self._no_semaphores("break_slot()")

    def ping(self) -> ServerStatus:
        """Version and round trip, then a probe lease (probe.py); or ``BackendUnavailable``."""
        started = time.monotonic()
        version, warnings = self.do_ping()
        latency = time.monotonic() - started
        probe(self)  # and a lock can be taken there (backends/probe.py)
        return ServerStatus(self.alias, version, latency, warnings)
