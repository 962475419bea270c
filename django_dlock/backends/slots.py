"""Semaphores and read/write locks on a backend: :class:`SlotAttempt` and their listing.

A semaphore of limit N lets N holders in at once; each has a lease of its
own (a "slot") with a fencing token from the name's counter. A read/write
lock is the same thing with a weight per holder: its limit is
:data:`RW_LIMIT`, a reader weighs 1 and a writer weighs the whole limit, so a
writer enters alone and readers enter together. A writer that waits is
recorded on the service, and readers do not enter past it (no starvation).

A slot is acquired through ``BaseLockBackend.acquire(name, limit=N,
weight=W)``; its kind of lease is ``ops.SlotOps``, whose calls go to the
backend's ``*_slot`` primitives (``semaphore_backend.SemaphoreBackend``).
Everything above the primitives (the acquire loop, :class:`HeldLock`, the
watchdog, async) is the mutex's, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .attempts import Attempt
from .limits import MAX_LIMIT, RW_LIMIT, describe_limit, validate_limit
from .types import ParkedTask, SemaphoreInfo, SlotEntry

if TYPE_CHECKING:
    pass


class SlotAttempt(Attempt):
    """One acquisition of a slot: giving up withdraws its waiter record.

    Its waits are at most a third of its TTL apart, so that the waiter record
    (which ends a TTL after the last try) is refreshed before it runs out.
    """

    @property
    def limit(self) -> int:
        limit = self.ops.limit
        if limit is None:  # a slot attempt is made by SlotOps, which has one
            raise TypeError(f"{self!r} is not an attempt at a semaphore's slot.")
        return limit

    @property
    def weight(self) -> int:
        return self.ops.weight

    def wait(self, remaining: float | None) -> None:
        bound = self.ttl / 3
        super().wait(bound if remaining is None else min(remaining, bound))

    async def await_free(self, remaining: float | None) -> None:
        bound = self.ttl / 3
        await super().await_free(bound if remaining is None else min(remaining, bound))

    def abandon(self) -> None:
        self.ops.leave(self.name, self.owner)


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


__all__ = [
    "MAX_LIMIT",
    "RW_LIMIT",
    "SlotAttempt",
    "describe_limit",
    "list_semaphores",
    "validate_limit",
]
