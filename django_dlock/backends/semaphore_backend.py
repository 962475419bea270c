"""The semaphore part of the contract: :class:`SemaphoreBackend`, opt-in.

A backend that keeps semaphores and read/write locks derives from
:class:`SemaphoreBackend` (instead of, or besides, ``BaseLockBackend``) and
implements its seven ``*_slot`` primitives, each documented below with its
rule; ``supports_semaphores`` is then True. Their leases live in a keyspace
of their own, apart from the mutexes: ``get``/``list``/``break_lock`` are the
mutexes', ``semaphore``/``semaphores``/``break_slot`` the semaphores'. A
semaphore's slot is acquired through the one public call,
``acquire(name, limit=N, weight=W)`` (``ops.SlotOps``).

A semaphore of limit N lets N holders in at once; each has a lease of its
own (a "slot") with a fencing token from the name's counter. A read/write
lock is the same thing with a weight per holder: its limit is
``limits.RW_LIMIT``, a reader weighs 1 and a writer weighs the whole
limit, so a writer enters alone and readers enter together. A writer that
waits is recorded on the service, and readers do not enter past it (no
starvation). Everything above the primitives (the acquire loop,
:class:`~django_dlock.held.HeldLock`, the watchdog, async) is the mutex's.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from .._validation import validate_name
from ..exceptions import LimitMismatch
from ..signals import lock_broken
from .attempts import Attempt
from .base import BaseLockBackend
from .limits import RW_LIMIT, describe_limit, validate_limit
from .ops import MutexOps, SlotOps
from .parking_backend import ParkingBackend
from .types import Grant, ParkedTask, SemaphoreInfo, SlotEntry, extend_each


class SemaphoreBackend(BaseLockBackend):
    """A backend with semaphores and read/write locks: the seven ``*_slot`` primitives."""

    supports_semaphores: ClassVar[bool] = True
    #: Are a semaphore's waiters granted in the order they first asked?
    supports_fair_semaphores: ClassVar[bool] = False
    #: What one acquisition of a slot makes (None: ``ops.SlotAttempt``).
    slot_attempt_class: ClassVar[type[Attempt] | None] = None

    @property
    def native_async_slots(self) -> bool:
        """Do the awaitable slot primitives (and the slot attempt's) talk from the event loop?

        Otherwise an async acquisition of a slot tries in the backend's own
        threads. Redis on one server says yes (``redis/semaphores_aio.py``).
        """
        return False

    def do_acquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> int | Grant | None:
        """One atomic attempt at a slot of ``weight`` in semaphore ``name`` of ``limit``.

        Drop the holders and waiters of ``name`` whose leases ended by the
        service's clock. If a live holder or waiter has another limit, raise
        ``self.limit_mismatch(name, limit, theirs)``. Grant ``owner`` a slot
        (as ``do_acquire``: a token from the name's fencing counter, a lease
        of ``ttl``, ``holder`` stored) if the weights held plus ``weight`` fit
        in ``limit`` and, when ``weight < limit``, no other owner waits with
        ``weight == limit`` (a writer: a waiting writer stops new readers);
        granted, ``owner``'s waiter record goes. Refused, record or refresh
        ``owner`` as a waiter (``weight``, ``limit``, ending ``ttl`` from now)
        and return None. A backend that queues waiters (etcd) grants in
        arrival order.
        """
        raise NotImplementedError

    def do_leave_slot(self, name: str, owner: str) -> None:
        """Forget ``owner``'s waiter record on ``name`` (its attempt gave up)."""
        raise NotImplementedError

    def do_release_slot(self, name: str, owner: str) -> bool:
        """As ``do_release``, for ``owner``'s slot: owner-checked on the service, atomically."""
        raise NotImplementedError

    def do_extend_slot(self, name: str, owner: str, ttl: float) -> bool:
        """As ``do_extend``: make ``owner``'s live slot run ``ttl`` from now; False if gone."""
        raise NotImplementedError

    def do_check_slot(self, name: str, owner: str) -> bool:
        """As ``do_check``: whether ``owner`` holds a live slot of ``name`` now."""
        raise NotImplementedError

    def do_break_slot(self, name: str, token: int | None) -> int:
        """Delete the slot of ``name`` with fencing token ``token`` (None: every one); how many."""
        raise NotImplementedError

    def do_list_slots(self, prefix: str) -> builtins.list[SlotEntry]:
        """The live holders and waiters of the semaphores whose names start with ``prefix``."""
        raise NotImplementedError

    def do_extend_slots_many(
        self, leases: Sequence[tuple[str, str, float]]
    ) -> builtins.list[bool | Exception]:
        """Renew up to ``renew_batch`` slots, as ``do_extend_many``; default: one at a time."""
        return extend_each(self.do_extend_slot, leases)

    # The awaitable slot primitives: in a thread of the ``ops`` executor
    # unless the backend has native ones (``native_async_slots``).

    async def ado_leave_slot(self, name: str, owner: str) -> None:
        await asyncio.wrap_future(self.offload.submit("ops", self.do_leave_slot, name, owner))

    async def ado_release_slot(self, name: str, owner: str) -> bool:
        return await asyncio.wrap_future(
            self.offload.submit("ops", self.do_release_slot, name, owner)
        )

    async def ado_extend_slot(self, name: str, owner: str, ttl: float) -> bool:
        return await asyncio.wrap_future(
            self.offload.submit("ops", self.do_extend_slot, name, owner, ttl)
        )

    async def ado_check_slot(self, name: str, owner: str) -> bool:
        return await asyncio.wrap_future(
            self.offload.submit("ops", self.do_check_slot, name, owner)
        )

    def limit_mismatch(self, name: str, limit: int, held_limit: int) -> LimitMismatch:
        """The error ``do_acquire_slot`` raises when ``name`` is held with another limit."""
        return LimitMismatch(
            f"Semaphore {name!r} on backend {self.alias!r} is held as "
            f"{describe_limit(held_limit)}, not as {describe_limit(limit)}: release "
            "its holders (or let their leases end) before changing its limit.",
            name=name,
            backend=self.alias,
            limit=limit,
            held_limit=held_limit,
        )

    # --- the public semaphore API ---------------------------------------------------

    def ops(self, limit: int | None = None, weight: int = 1) -> MutexOps | SlotOps:
        """A mutex for ``limit=None``, else a slot of ``weight`` in the semaphore of ``limit``."""
        if limit is None or not self.supports_semaphores:
            return super().ops(limit, weight)
        if limit != RW_LIMIT:  # a read/write lock's is past MAX_LIMIT
            limit = validate_limit(limit)
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= limit:
            raise ValueError(f"weight must be an int from 1 to the limit, not {weight!r}.")
        if limit == RW_LIMIT and weight not in (1, RW_LIMIT):
            raise ValueError(
                "A read/write lock is entered with weight 1 (a reader) or RW_LIMIT (a writer), "
                f"not {weight!r}."
            )
        return SlotOps(self, limit, weight)

    def semaphores(self, prefix: str = "") -> builtins.list[SemaphoreInfo]:
        """Semaphores and read/write locks whose names start with ``prefix``, sorted by name.

        Each with its limit, its holders (by fencing token), how many wait,
        and how many Celery tasks are parked on it.
        """
        prefix = validate_name(prefix, what="A lock name prefix")
        return list_semaphores(self.alias, self.do_list_slots(prefix), self._parked_calls(prefix))

    def _parked_calls(self, prefix: str) -> builtins.list[ParkedTask]:
        # Parked Celery calls, on a backend that also has the parking part.
        return self.do_list_parked(prefix) if isinstance(self, ParkingBackend) else []

    def semaphore(self, name: str) -> SemaphoreInfo | None:
        """The semaphore or read/write lock ``name`` (not one whose name starts so), or None."""
        name = validate_name(name)
        found = list_semaphores(self.alias, self.do_list_slots(name), self._parked_calls(name))
        return next((info for info in found if info.name == name), None)

    def break_slot(self, name: str, token: int | None = None) -> int:
        """Free the slot of semaphore (or read/write lock) ``name`` with fencing token ``token``.

        None frees every slot. Returns how many were freed; their holders
        find out as a mutex's do (``LockLost``).
        """
        name = validate_name(name)
        if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
            raise TypeError(f"token must be an int or None, not {type(token).__name__}.")
        broken = self.do_break_slot(name, token)
        if broken:
            lock_broken.send(sender=type(self), backend=self.alias, name=name, token=token)
        return broken


def list_semaphores(
    alias: str, slots: Iterable[SlotEntry], parked_tasks: Iterable[ParkedTask]
) -> list[SemaphoreInfo]:
    """The semaphores and read/write locks of ``slots``, with the tasks parked on them."""
    groups: dict[str, dict[str, Any]] = {}

    def group(name: str, limit: int) -> dict[str, Any]:
        return groups.setdefault(name, {"limit": limit, "holders": [], "waiting": 0, "parked": 0})

    for entry in slots:
        g = group(entry.name, entry.limit)
        if entry.info is None:
            g["waiting"] += 1
        else:
            g["holders"].append((entry.info, entry.weight))
    for parked in parked_tasks:
        groups.setdefault(parked.name, {"limit": 0, "holders": [], "waiting": 0, "parked": 0})[
            "parked"
        ] += 1
    infos = []
    for name, g in sorted(groups.items()):
        held = sorted(g["holders"], key=lambda pair: pair[0].token)
        rw = g["limit"] == RW_LIMIT
        infos.append(
            SemaphoreInfo(
                backend=alias,
                name=name,
                kind="rwlock" if rw else "semaphore",
                limit=g["limit"],
                holders=tuple(info for info, _ in held),
                modes=tuple(
                    ("write" if weight == RW_LIMIT else "read") if rw else "slot"
                    for _, weight in held
                ),
                waiting=g["waiting"],
                parked=g["parked"],
            )
        )
    return infos


__all__ = ["SemaphoreBackend"]
