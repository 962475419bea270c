"""Who holds what, across backends: the listing service of ``manage.py locks`` and the admin.

Both surfaces list through here, so that they show the same columns, and
break through :func:`break_holder` (a mutex's lease) and :func:`break_slot`
(one holder's slot of a semaphore or read/write lock), which name the fencing
token they saw: a lease that was released and taken again since it was
listed is left alone. The labels and columns both surfaces show are here
too; what only the terminal shows (JSON, tables, ``show``'s fields, shell
quoting) is in ``management/formatting.py``.

A mutex has one lease per name, so it is one row. A semaphore or read/write
lock is one :class:`Slot` row per holder, each carrying the name's limit and
its counts of waiting acquisitions and parked Celery calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .backends.base import LockInfo
from .backends.types import SemaphoreInfo
from .handler import locks

__all__ = ["break_holder", "current_holders", "find_holders"]


@dataclass(frozen=True)
class Slot:
    """One row of a semaphore or read/write lock: a holder's ``lease`` and its ``mode``.

    ``mode`` is "slot" (a semaphore's holder), "read" or "write". A name
    that nobody holds but that has waiters or parked calls is listed too, as
    one row whose ``lease`` and ``mode`` are None, so that a queue with no
    holder (the moment they are woken) is never invisible.
    """

    semaphore: SemaphoreInfo
    lease: LockInfo | None
    mode: str | None


@dataclass
class Listing:
    """Live leases on the backends asked, and the backends that did not answer.

    ``holders`` are mutexes' leases; ``slots`` the rows of semaphores and
    read/write locks, from the backends that have them.
    """

    holders: list[LockInfo] = field(default_factory=list)
    errors: dict[str, Exception] = field(default_factory=dict)
    taken_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    slots: list[Slot] = field(default_factory=list)


def aliases(backend: str | None = None) -> list[str]:
    """``[backend]``, or every configured alias when it is None."""
    return [backend] if backend is not None else list(locks)


def current_holders(backend: str | None = None, prefix: str = "") -> Listing:
    """Live leases and semaphore slots whose names start with ``prefix``, by backend, then name."""
    listing = Listing()
    for alias in aliases(backend):
        try:
            listing.holders.extend(locks[alias].list(prefix))
            _add_slots(listing, alias, prefix)
        except Exception as e:  # a backend's failure is reported, never a traceback
            listing.errors[alias] = e
    return listing


def find_holders(name: str, backend: str | None = None, *, slots: bool = False) -> Listing:
    """The live lease on ``name`` on each backend that has one: one ``get`` per backend.

    With ``slots``, also the rows of the semaphore or read/write lock
    called exactly ``name`` (a name of that keyspace may also be a mutex's).
    """
    listing = Listing()
    for alias in aliases(backend):
        try:
            info = locks[alias].get(name)
            if info is not None:
                listing.holders.append(info)
            if slots:
                _add_slots(listing, alias, name, exact=True)
        except Exception as e:  # a backend's failure is reported, never a traceback
            listing.errors[alias] = e
    return listing


def _add_slots(listing: Listing, alias: str, prefix: str, exact: bool = False) -> None:
    backend = locks[alias]
    if not backend.supports_semaphores:
        return
    for info in backend.semaphores(prefix):
        if not exact or info.name == prefix:
            listing.slots.extend(slots_of(info))


def slots_of(info: SemaphoreInfo) -> list[Slot]:
    """A row per holder of ``info``, by token; one empty row if it has none."""
    rows = [Slot(info, lease, mode) for lease, mode in zip(info.holders, info.modes, strict=True)]
    return rows or [Slot(info, None, None)]


def break_holder(info: LockInfo) -> bool:
    """Break the lease ``info`` describes, if it is still that lease (same fencing token)."""
    return locks[info.backend].break_lock(info.name, token=info.token)


def break_slot(slot: Slot) -> bool:
    """Free the one slot ``slot`` lists, by its fencing token; False if it ended since."""
    if slot.lease is None:
        return False
    return locks[slot.lease.backend].break_slot(slot.lease.name, slot.lease.token) > 0


def slot_label(slot: Slot) -> str:
    """``the slot of semaphore`` or ``the read slot of read/write lock``: the name follows."""
    if slot.semaphore.kind == "rwlock":
        mode = f"{slot.mode} " if slot.mode else ""
        return f"the {mode}slot of read/write lock"
    return "the slot of semaphore"


def limit_label(info: SemaphoreInfo) -> str | None:
    """The semaphore's limit as shown; None for a read/write lock (one writer or any
    number of readers) and for a name known only by its parked calls."""
    return str(info.limit) if info.kind == "semaphore" and info.limit > 0 else None


def holder_label(holder: dict[str, Any]) -> str:
    """``host:pid``, then ``task_name[task_id]`` for a Celery task."""
    label = f"{holder.get('host', '?')}:{holder.get('pid', '?')}"
    if holder.get("task_name"):
        label += f" {holder['task_name']}[{holder.get('task_id', '?')}]"
    return label


def held_for(info: LockInfo, now: datetime) -> float:
    """Seconds since the lease was granted (never negative when clocks disagree)."""
    return max(0.0, (now - info.acquired_at).total_seconds())


def duration(seconds: float) -> str:
    """``4.2s``, ``3m05s``, ``2h01m``, ``3d04h``; ``never`` for a lease with no end."""
    if math.isinf(seconds):
        return "never"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


#: The columns of ``manage.py locks`` and of the admin's list.
COLUMNS = ("BACKEND", "NAME", "TOKEN", "HOLDER", "HELD FOR", "EXPIRES IN")


def columns(info: LockInfo, now: datetime) -> tuple[str, ...]:
    return (
        info.backend,
        info.name,
        str(info.token),
        holder_label(info.holder),
        duration(held_for(info, now)),
        duration(info.expires_in),
    )


#: The columns of the semaphores and read/write locks in ``manage.py locks`` and the admin.
SLOT_COLUMNS = (
    "BACKEND",
    "NAME",
    "KIND",
    "LIMIT",
    "MODE",
    "TOKEN",
    "HOLDER",
    "HELD FOR",
    "EXPIRES IN",
    "WAITING",
    "PARKED",
)


def slot_columns(slot: Slot, now: datetime) -> tuple[str, ...]:
    sem, lease = slot.semaphore, slot.lease
    held: tuple[str, ...] = ("-", "-", "-", "-")
    if lease is not None:
        held = (
            str(lease.token),
            holder_label(lease.holder),
            duration(held_for(lease, now)),
            duration(lease.expires_in),
        )
    return (
        sem.backend,
        sem.name,
        sem.kind,
        limit_label(sem) or "-",
        slot.mode or "-",
        *held,
        str(sem.waiting),
        str(sem.parked),
    )
