"""Semaphores and read/write locks on a backend: :class:`SlotView` and :class:`SlotAttempt`.

A semaphore of limit N lets N holders in at once; each has a lease of its
own (a "slot") with a fencing token from the name's counter. A read/write
lock is the same thing with a weight per holder: its limit is
:data:`RW_LIMIT`, a reader weighs 1 and a writer weighs the whole limit, so a
writer enters alone and readers enter together. A writer that waits is
recorded on the service, and readers do not enter past it (no starvation).

A :class:`SlotView` is a backend seen through one limit and weight: its
``do_acquire``, ``do_release``... call the backend's ``*_slot`` primitives.
Everything above the primitives (the acquire loop, :class:`HeldLock`, the
watchdog, async) is the mutex's, unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .attempts import Attempt
from .types import Grant, SemaphoreInfo

if TYPE_CHECKING:
    from .base import BaseLockBackend

#: The limit of a read/write lock: a reader weighs 1, a writer all of it.
RW_LIMIT = 2**31 - 1
#: The largest ``limit`` a semaphore may have.
MAX_LIMIT = 1_000_000


def describe_limit(limit: int) -> str:
    return "a read/write lock" if limit == RW_LIMIT else f"a semaphore of limit {limit}"


def validate_limit(limit: object) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, not {type(limit).__name__}.")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}.")
    return limit


class SlotAttempt(Attempt):
    """One acquisition of a slot: giving up withdraws its waiter record.

    Its waits are at most a third of its TTL apart, so that the waiter record
    (which ends a TTL after the last try) is refreshed before it runs out.
    """

    backend: SlotView  # type: ignore[assignment]

    def wait(self, remaining: float | None) -> None:
        bound = self.ttl / 3
        super().wait(bound if remaining is None else min(remaining, bound))

    async def await_free(self, remaining: float | None) -> None:
        bound = self.ttl / 3
        await super().await_free(bound if remaining is None else min(remaining, bound))

    def abandon(self) -> None:
        self.backend.base.do_leave_slot(self.name, self.owner)


class SlotView:
    """``backend`` seen as the semaphore of ``limit``, acquired with ``weight``.

    It has what :class:`~django_dlock.handle.HeldLock`, the watchdog and the
    acquire loop use of a backend; the rest is read from ``backend``.
    """

    def __init__(self, backend: BaseLockBackend, limit: int, weight: int) -> None:
        if not backend.supports_semaphores:
            raise NotImplementedError(
                f"Lock backend {backend.alias!r} ({backend.path}) has no semaphores "
                "or read/write locks."
            )
        self.base = backend
        self.limit = limit
        self.weight = weight
        self.attempt_class = backend.slot_attempt_class or SlotAttempt
        # An async acquisition runs the sync loop in a worker thread.
        self.native_async = False
        # Every view's slots are renewed together, by do_extend_slots_many.
        self.renewal_key = (backend, "slots")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def __repr__(self) -> str:
        return f"<SlotView of {self.base!r} limit={self.limit} weight={self.weight}>"

    # --- what the acquire loop and HeldLock call --------------------------------------

    # The base class's loop, run on this view (BaseLockBackend is not imported:
    # base.py imports this module).
    def acquire(self, name: str, **kwargs: Any) -> Any:
        return type(self.base).acquire(self, name, **kwargs)  # type: ignore[arg-type]

    async def aacquire(self, name: str, **kwargs: Any) -> Any:
        return await type(self.base).aacquire(self, name, **kwargs)  # type: ignore[arg-type]

    def _acquire(self, *args: Any) -> Any:
        return type(self.base)._acquire(self, *args)  # type: ignore[arg-type]

    def _aacquire(self, *args: Any) -> Any:
        return type(self.base)._aacquire(self, *args)  # type: ignore[arg-type]

    def attempt(
        self, name: str, owner: str, ttl: float, holder: tuple[dict[str, Any], str], renew: bool
    ) -> Attempt:
        return self.attempt_class(self, name, owner, ttl, holder, renew)  # type: ignore[arg-type]

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        return self.base.do_acquire_slot(name, owner, ttl, holder, renew, self.limit, self.weight)

    def do_release(self, name: str, owner: str) -> bool:
        return self.base.do_release_slot(name, owner)

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        return self.base.do_extend_slot(name, owner, ttl)

    def do_check(self, name: str, owner: str) -> bool:
        return self.base.do_check_slot(name, owner)

    def do_extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]:
        return self.base.do_extend_slots_many(leases)

    # In the backend's own ``ops`` threads, as the mutex's (offload.py).
    async def ado_release(self, name: str, owner: str) -> bool:
        return await asyncio.wrap_future(
            self.base.offload.submit("ops", self.do_release, name, owner)
        )

    async def ado_extend(self, name: str, owner: str, ttl: float) -> bool:
        return await asyncio.wrap_future(
            self.base.offload.submit("ops", self.do_extend, name, owner, ttl)
        )

    async def ado_check(self, name: str, owner: str) -> bool:
        return await asyncio.wrap_future(
            self.base.offload.submit("ops", self.do_check, name, owner)
        )

    def do_detach(self, name: str, owner: str) -> Any:
        raise NotImplementedError(
            "A semaphore's or read/write lock's slot cannot be handed to another process."
        )


def list_semaphores(backend: BaseLockBackend, prefix: str) -> list[SemaphoreInfo]:
    """The semaphores and read/write locks under ``prefix``: holders, waiters, parked tasks."""
    groups: dict[str, dict[str, Any]] = {}

    def group(name: str, limit: int) -> dict[str, Any]:
        return groups.setdefault(name, {"limit": limit, "holders": [], "waiting": 0, "parked": 0})

    for entry in backend.do_list_slots(prefix):
        g = group(entry.name, entry.limit)
        if entry.info is None:
            g["waiting"] += 1
        else:
            g["holders"].append((entry.info, entry.weight))
    for parked in backend.do_list_parked(prefix):
        groups.setdefault(parked.name, {"limit": 0, "holders": [], "waiting": 0, "parked": 0})[
            "parked"
        ] += 1
    infos = []
    for name, g in sorted(groups.items()):
        held = sorted(g["holders"], key=lambda pair: pair[0].token)
        rw = g["limit"] == RW_LIMIT
        infos.append(
            SemaphoreInfo(
                backend=backend.alias,
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


__all__ = [
    "MAX_LIMIT",
    "RW_LIMIT",
    "SlotAttempt",
    "SlotView",
    "describe_limit",
    "list_semaphores",
    "validate_limit",
]
