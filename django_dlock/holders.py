"""Who holds what, across backends: what ``manage.py locks`` and the admin show.

Both surfaces list through here, so that they show the same columns, and
break through :func:`break_holder`, which names the fencing token it saw: a
lease that was released and taken again since it was listed is left alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .backends.base import LockInfo, SemaphoreInfo
from .exceptions import DLockError
from .handler import locks

#: The holder fields shown in their own columns or in the HOLDER column;
#: ``show`` and the admin's detail list everything else after them.
HOLDER_FIELDS = ("host", "pid", "thread", "acquired_at", "ttl", "task_name", "task_id")


@dataclass
class Listing:
    """Live leases on the backends asked, and the backends that did not answer."""

    holders: list[LockInfo] = field(default_factory=list)
    errors: dict[str, DLockError] = field(default_factory=dict)
    taken_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


def aliases(backend: str | None = None) -> list[str]:
    """``[backend]``, or every configured alias when it is None."""
    return [backend] if backend is not None else list(locks)


def current_holders(backend: str | None = None, prefix: str = "") -> Listing:
    """Live leases whose names start with ``prefix``, by backend alias, then name."""
    listing = Listing()
    for alias in aliases(backend):
        try:
            listing.holders.extend(locks[alias].list(prefix))
        except DLockError as e:
            listing.errors[alias] = e
    return listing


def find_holders(name: str, backend: str | None = None) -> Listing:
    """The live lease on ``name`` on each backend that has one: one ``get`` per backend."""
    listing = Listing()
    for alias in aliases(backend):
        try:
            info = locks[alias].get(name)
        except DLockError as e:
            listing.errors[alias] = e
            continue
        if info is not None:
            listing.holders.append(info)
    return listing


def break_holder(info: LockInfo) -> bool:
    """Break the lease ``info`` describes, if it is still that lease (same fencing token)."""
    return locks[info.backend].break_lock(info.name, token=info.token)


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


_encode_str = json.encoder.encode_basestring_ascii  # the C encoder when available


def as_json(info: LockInfo, now: datetime) -> str:
    """One lease as a JSON object: backend, name, token, holder (an object),
    acquired_at and expires_at (ISO 8601), expires_in and held_for (seconds);
    a lease with no end has null ``expires_*``.

    Built as text rather than through ``json.dumps`` of a dict, in a third of
    the time (``manage.py locks --json`` with 100,000 leases). The holder's
    stored JSON text is copied when the backend kept it
    (``LockInfo.holder_json``) and it is ASCII, as ``dump_holder`` writes
    it; strings are escaped to ASCII, so no control character reaches a
    terminal.
    """
    holder = info.holder_json
    if holder is None or not holder.isascii():
        holder = json.dumps(info.holder)
    held = (now - info.acquired_at).total_seconds()
    if info.expires_in == math.inf:
        expires = '"expires_at":null,"expires_in":null'
    else:
        expires = f'"expires_at":"{info.expires_at.isoformat()}","expires_in":{info.expires_in!r}'
    return (
        f'{{"backend":{_encode_str(info.backend)},"name":{_encode_str(info.name)},'
        f'"token":{info.token},"holder":{holder},'
        f'"acquired_at":"{info.acquired_at.isoformat()}",{expires},'
        f'"held_for":{held if held > 0 else 0.0!r}}}'
    )


def printable(text: str) -> str:
    """``text`` with control characters escaped, so a name cannot drive the terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def table(rows: Iterable[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    """Left-aligned columns two spaces apart; the header is the first line."""
    cells = [header, *(tuple(printable(cell) for cell in row) for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    last = len(header) - 1
    return [
        "  ".join(cell if i == last else cell.ljust(widths[i]) for i, cell in enumerate(row))
        for row in cells
    ]


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


# --- semaphores and read/write locks ------------------------------------------------


@dataclass
class SemaphoreListing:
    """Semaphores and read/write locks on the backends asked, and those that did not answer."""

    semaphores: list[SemaphoreInfo] = field(default_factory=list)
    errors: dict[str, DLockError] = field(default_factory=dict)
    taken_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


def current_semaphores(backend: str | None = None, prefix: str = "") -> SemaphoreListing:
    """Semaphores under ``prefix`` on each backend that has them, by alias, then name."""
    listing = SemaphoreListing()
    for alias in aliases(backend):
        lock_backend = locks[alias]
        if not lock_backend.supports_semaphores:
            continue
        try:
            listing.semaphores.extend(lock_backend.semaphores(prefix))
        except DLockError as e:
            listing.errors[alias] = e
    return listing


def find_semaphores(name: str, backend: str | None = None) -> SemaphoreListing:
    """The semaphore (or read/write lock) called exactly ``name`` on each backend."""
    listing = current_semaphores(backend, name)
    listing.semaphores = [info for info in listing.semaphores if info.name == name]
    return listing


def break_slot(info: SemaphoreInfo, token: int) -> bool:
    """Free the slot of ``info`` with fencing token ``token``, if it is still held."""
    return locks[info.backend].break_slot(info.name, token=token) == 1


#: The columns of the semaphore table of ``manage.py locks`` and of the admin.
SEMAPHORE_COLUMNS = (
    "BACKEND", "NAME", "KIND", "LIMIT", "MODE", "TOKEN", "HOLDER", "HELD FOR", "EXPIRES IN",
    "WAITING", "PARKED",
)  # fmt: skip


def semaphore_rows(info: SemaphoreInfo, now: datetime) -> list[tuple[str, ...]]:
    """One row per holder (by token); one row of dashes for a name with none."""
    limit = "-" if not info.limit else ("-" if info.kind == "rwlock" else str(info.limit))
    waiting, parked = str(info.waiting), str(info.parked)
    if not info.holders:
        return [(info.backend, info.name, info.kind, limit, "-", "-", "-", "-", "-",
                 waiting, parked)]  # fmt: skip
    return [
        (
            info.backend,
            info.name,
            info.kind,
            limit,
            mode,
            str(h.token),
            holder_label(h.holder),
            duration(held_for(h, now)),
            duration(h.expires_in),
            waiting,
            parked,
        )
        for h, mode in zip(info.holders, info.modes, strict=True)
    ]


def semaphore_json(info: SemaphoreInfo, now: datetime) -> list[str]:
    """Its holders as ``as_json`` objects with ``kind``, ``limit``, ``mode``, ``waiting``
    and ``parked`` added; a name with no holder (only waiters or parked calls) as one
    object whose ``token`` and ``holder`` are null."""
    extra = {
        "kind": info.kind,
        "limit": None if info.kind == "rwlock" else info.limit or None,
        "waiting": info.waiting,
        "parked": info.parked,
    }
    if not info.holders:
        return [json.dumps({"backend": info.backend, "name": info.name, "token": None,
                            "holder": None, **extra, "mode": None})]  # fmt: skip
    return [
        as_json(h, now)[:-1] + "," + json.dumps({**extra, "mode": mode})[1:]
        for h, mode in zip(info.holders, info.modes, strict=True)
    ]
