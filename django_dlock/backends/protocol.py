"""What the handle, the acquire loop and the watchdog need of a backend and of a lease.

A leaf module: it imports nothing from the package but value types
(``types.py``, ``offload.py``), so that ``held.py``, ``attempts.py``,
``leases.py``, ``renewer.py``, ``watchdog.py`` and ``transactions.py`` can
be typed against these protocols without importing ``base.py`` (which
imports them): the import graph has no circle, even counting the imports
under ``if TYPE_CHECKING:`` (``tests/test_imports.py``).

:class:`LockService` is the part of
:class:`~django_dlock.backends.base.BaseLockBackend` those modules use;
:class:`LeaseOps` is one kind of lease on it (``ops.py``: a mutex or a
semaphore's slot); :class:`Renewable` is the part of
:class:`~django_dlock.held.HeldLock` the watchdog uses.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from .offload import Offload
from .types import Grant, LockInfo, SemaphoreInfo


class LockService(Protocol):
    """A backend as a handle and an attempt see it (``BaseLockBackend`` is one)."""

    alias: str
    offload: Offload

    @property
    def supports_shared_leases(self) -> bool: ...

    @property
    def renew_batch(self) -> int: ...

    @property
    def uses_django_connections(self) -> bool: ...

    def drift(self, ttl: float) -> float: ...

    def session_end(self, owner: str) -> float: ...

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None: ...

    def do_release(self, name: str, owner: str) -> bool: ...

    def do_check(self, name: str, owner: str) -> bool: ...

    def list(self, prefix: str = "") -> list[LockInfo]: ...

    def do_get(self, name: str) -> LockInfo | None: ...


class MutexBackend(LockService, Protocol):
    """A backend's mutex primitives, as ``ops.MutexOps`` calls them (``BaseLockBackend``)."""

    @property
    def attempt_class(self) -> type[Any]: ...

    @property
    def renewal_key(self) -> Hashable: ...

    @property
    def native_async(self) -> bool: ...

    def do_extend(self, name: str, owner: str, ttl: float) -> bool: ...

    def do_extend_many(
        self, leases: Sequence[tuple[str, str, float]]
    ) -> list[bool | Exception]: ...

    def do_detach(self, name: str, owner: str) -> Any: ...

    async def ado_release(self, name: str, owner: str) -> bool: ...

    async def ado_extend(self, name: str, owner: str, ttl: float) -> bool: ...

    async def ado_check(self, name: str, owner: str) -> bool: ...

    def get(self, name: str) -> LockInfo | None: ...

    def break_lock(self, name: str, token: int | None = None) -> bool: ...


class SlotBackend(LockService, Protocol):
    """A backend's slot primitives, as ``ops.SlotOps`` calls them (``SemaphoreBackend``)."""

    @property
    def slot_attempt_class(self) -> type[Any] | None: ...

    @property
    def native_async_slots(self) -> bool: ...

    def do_acquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> int | Grant | None: ...

    def do_leave_slot(self, name: str, owner: str) -> None: ...

    def do_release_slot(self, name: str, owner: str) -> bool: ...

    def do_extend_slot(self, name: str, owner: str, ttl: float) -> bool: ...

    def do_check_slot(self, name: str, owner: str) -> bool: ...

    def do_extend_slots_many(
        self, leases: Sequence[tuple[str, str, float]]
    ) -> list[bool | Exception]: ...

    async def ado_release_slot(self, name: str, owner: str) -> bool: ...

    async def ado_extend_slot(self, name: str, owner: str, ttl: float) -> bool: ...

    async def ado_check_slot(self, name: str, owner: str) -> bool: ...

    def semaphore(self, name: str) -> SemaphoreInfo | None: ...

    def break_slot(self, name: str, token: int | None = None) -> int: ...


class LeaseOps(Protocol):
    """One kind of lease on a backend: a mutex, or a slot of a semaphore (``ops.py``).

    Everything a handle, an attempt and the watchdog do to a lease goes
    through it, so that they never ask which kind it is.
    """

    @property
    def backend(self) -> LockService: ...

    #: None for a mutex; else the semaphore's limit (``limits.RW_LIMIT``: a read/write lock).
    @property
    def limit(self) -> int | None: ...

    @property
    def weight(self) -> int: ...

    #: Leases whose keys are equal are renewed together (one ``extend_many``).
    @property
    def renewal_key(self) -> Hashable: ...

    #: Do the awaitable operations talk to the service from the event loop?
    @property
    def native_async(self) -> bool: ...

    def try_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool
    ) -> int | Grant | None: ...

    def leave(self, name: str, owner: str) -> None: ...

    def release(self, name: str, owner: str) -> bool: ...

    def extend(self, name: str, owner: str, ttl: float) -> bool: ...

    def check(self, name: str, owner: str) -> bool: ...

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]: ...

    def detach(self, name: str, owner: str) -> Any: ...

    def get(self, name: str, token: int) -> LockInfo | None:
        """The lease of ``token`` on ``name``, as listed, in this kind's keyspace."""
        ...

    def break_lease(self, name: str, token: int) -> bool:
        """Break the lease of ``token`` on ``name`` in this kind's keyspace."""
        ...

    async def arelease(self, name: str, owner: str) -> bool: ...

    async def aextend(self, name: str, owner: str, ttl: float) -> bool: ...

    async def acheck(self, name: str, owner: str) -> bool: ...


class Request:
    """An extend or renewal of a handle: sent at ``sent`` (``time.monotonic()``) with ``ttl``."""

    __slots__ = ("answered", "sent", "ttl")

    def __init__(self, sent: float, ttl: float) -> None:
        self.sent = sent
        self.ttl = ttl
        #: When its reply or error came back; None while in flight.
        self.answered: float | None = None


class Renewable(Protocol):
    """A held lease as the watchdog and its renewal threads see it (``HeldLock`` is one)."""

    name: str
    owner: str
    ttl: float
    backend: LockService
    ops: LeaseOps
    renewing: bool
    watchdog_generation: int

    @property
    def alias(self) -> str: ...

    @property
    def expires_at(self) -> float: ...

    @property
    def released(self) -> bool: ...

    @property
    def detached(self) -> bool: ...

    def on_watchdog(self, due: float) -> None: ...

    def renewal_wanted(self) -> bool: ...

    def renewal_lost(self, reason: str) -> None: ...

    def renewal_sending(self) -> Request: ...

    def renewal_done(self, request: Request, result: bool | Exception) -> Exception | None: ...

    def lost_on_server(self, reason: str) -> None: ...

    def release_quietly(self) -> bool: ...

    def ensure(self) -> None: ...


class Scheduler(Protocol):
    """The watchdog as a backend's renewal thread sees it (``watchdog.Watchdog`` is one)."""

    def schedule(self, held: Renewable, delay: float) -> None: ...

    def scheduled(self, alias: str) -> list[Renewable]: ...

    def call_at(self, due: float, action: Callable[[], None]) -> None: ...
