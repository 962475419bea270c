"""Who holds what, across backends: what ``manage.py locks`` and the admin show.

Both surfaces list through here, so that they show the same columns, and
break through :func:`break_holder` (a mutex's lease) and :func:`break_slot`
(one holder's slot of a semaphore or read/write lock), which name the fencing
token they saw: a lease that was released and taken again since it was
listed is left alone.

A mutex has one lease per name, so it is one row. A semaphore or read/write
lock is one :class:`Slot` row per holder, each carrying the name's limit and
its counts of waiting acquisitions and parked Celery calls.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import islice
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from ._validation import printable as printable
from .backends.base import LockInfo
from .backends.types import SemaphoreInfo
from .exceptions import DLockError
from .handler import locks

#: The holder fields shown in their own columns or in the HOLDER column;
#: ``show`` and the admin's detail list everything else after them.
HOLDER_FIELDS = ("host", "pid", "thread", "acquired_at", "ttl", "task_name", "task_id")


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


def failure_text(error: Exception) -> str:
    """What a tool says of a backend's failure: its message, or its type when unexpected.

    The tools report each backend's failure by its alias and go on with the
    others: a ``BackendUnavailable`` or a ``LockConfigurationError`` (bad
    settings) by its message, anything else (a client library's own
    error) with its type, so that it can be told from ours.
    """
    if isinstance(error, (DLockError, ImproperlyConfigured)):
        return str(error)
    return f"{type(error).__name__}: {error}"


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


#: Leases written to ``manage.py locks --json``'s output at a time.
JSON_BATCH = 1000


def iter_json(
    backend: str | None, prefix: str, now: datetime, errors: dict[str, Exception]
) -> Iterator[str]:
    """The objects of ``[...]`` that ``current_holders`` as JSON holds, in its order, streamed.

    Each piece is a run of comma-separated JSON objects (:func:`leases_as_json`,
    :func:`slot_as_json`): the mutexes' leases of each backend as its
    :meth:`~django_dlock.backends.base.BaseLockBackend.iter_list` gives
    them, then the semaphores' rows. A backend that fails is added to
    ``errors`` and skipped from then on; the leases it gave before it failed
    have been yielded already.
    """
    for alias in aliases(backend):
        try:
            leases = locks[alias].iter_list(prefix)
            while batch := list(islice(leases, JSON_BATCH)):
                yield leases_as_json(batch, now)
        except Exception as e:  # a backend's failure is reported, never a traceback
            errors[alias] = e
    for alias in aliases(backend):
        if alias in errors or not locks[alias].supports_semaphores:
            continue
        try:
            rows = [slot for info in locks[alias].semaphores(prefix) for slot in slots_of(info)]
        except Exception as e:  # a backend's failure is reported, never a traceback
            errors[alias] = e
            continue
        if rows:
            yield ",".join([slot_as_json(slot, now) for slot in rows])


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


_encode_str = json.encoder.encode_basestring_ascii  # the C encoder when available


def as_json(info: LockInfo, now: datetime) -> str:
    """One mutex's lease as a JSON object: backend, name, token, holder (an object),
    acquired_at and expires_at (ISO 8601), expires_in and held_for (seconds),
    and kind ("mutex"); a lease with no end has null ``expires_*``.
    """
    return leases_as_json([info], now)


def leases_as_json(infos: Iterable[LockInfo], now: datetime) -> str:
    """Mutexes' leases as :func:`as_json` writes each, comma-separated.

    Built as text rather than through ``json.dumps`` of a dict, in a third of
    the time, and in one loop rather than a call per lease (``manage.py locks
    --json`` with a million leases). The holder's stored JSON text is copied
    when the backend kept it (``LockInfo.holder_json``) and it is ASCII, as
    ``dump_holder`` writes it; strings are escaped to ASCII, so no control
    character reaches a terminal.
    """
    return ",".join([f'{{{fields},"kind":"mutex"}}' for fields in _lease_fields(infos, now)])


def _lease_fields(infos: Iterable[LockInfo], now: datetime) -> Iterator[str]:
    """The JSON members of each lease, without braces (a slot's row adds its own)."""
    encode, inf = _encode_str, math.inf
    for info in infos:
        holder = info.holder_json
        if holder is None or not holder.isascii() or "NaN" in holder or "Infinity" in holder:
            holder = finite_json(info.holder)
        held = (now - info.acquired_at).total_seconds()
        if info.expires_in == inf:
            expires = '"expires_at":null,"expires_in":null'
        else:
            expires = (
                f'"expires_at":"{info.expires_at.isoformat()}","expires_in":{info.expires_in!r}'
            )
        yield (
            f'"backend":{encode(info.backend)},"name":{encode(info.name)},'
            f'"token":{info.token},"holder":{holder},'
            f'"acquired_at":"{info.acquired_at.isoformat()}",{expires},'
            f'"held_for":{held if held > 0 else 0.0!r}'
        )


def finite_json(value: Any) -> str:
    """``json.dumps(value)``, with NaN and the infinities as the strings "NaN", "Infinity".

    JSON has no such numbers; ``dump_holder`` refuses them, but a lease
    written by another version or straight to the lock service may hold
    them, and one of them would make a whole listing invalid JSON.
    """
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value).replace("inf", "Infinity").replace("nan", "NaN")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def slot_as_json(slot: Slot, now: datetime) -> str:
    """One row of a semaphore or read/write lock as a JSON object.

    The keys of :func:`as_json` (null when nobody holds a slot), with kind
    ("semaphore" or "rwlock"), limit (null for a read/write lock), mode
    ("slot", "read", "write"; null with no holder), and the name's waiting
    and parked counts.
    """
    sem = slot.semaphore
    limit = limit_label(sem)
    extra = json.dumps(
        {
            "kind": sem.kind,
            "limit": None if limit is None else sem.limit,
            "mode": slot.mode,
            "waiting": sem.waiting,
            "parked": sem.parked,
        },
        separators=(",", ":"),
    )[1:-1]
    if slot.lease is not None:
        (fields,) = _lease_fields([slot.lease], now)
        return f"{{{fields},{extra}}}"
    nobody = {"backend": sem.backend, "name": sem.name, "token": None, "holder": None}
    nobody.update(dict.fromkeys(("acquired_at", "expires_at", "expires_in", "held_for")))
    return f"{{{json.dumps(nobody, separators=(',', ':'))[1:-1]},{extra}}}"


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


def slots_left(left: list[Slot]) -> str:
    """Why the slots in ``left`` were not freed, and how to free them."""
    names = sorted({(slot.semaphore.kind, slot.semaphore.name) for slot in left})
    tokens = [str(slot.lease.token) for slot in left if slot.lease is not None]
    shown = ", ".join(tokens[:5]) + (", ..." if len(tokens) > 5 else "")
    if len(names) == 1:
        kind, name = names[0]
        kind = "read/write lock" if kind == "rwlock" else "semaphore"
        what = f"{kind} '{printable(name)}' has {len(left)} holder(s)"
        how = f"manage.py locks break --token {tokens[0]} -- {shell_quote(name)}"
    else:
        what = f"{len(names)} semaphores and read/write locks have {len(left)} holders"
        how = "manage.py locks break NAME --token TOKEN"
    return (
        f"{what} (tokens {shown}). Breaking frees one holder's slot, chosen by its "
        f"fencing token: `{how}`. --all-slots frees every one."
    )


def shell_quote(text: str) -> str:
    """``text`` as one word for a POSIX shell that bash, zsh and ksh read back exactly.

    ``shlex.quote`` when it is printable; otherwise ANSI-C quoting
    (``$'...'``) with every control character escaped, so that pasting the
    hint gives the name back and printing it cannot drive the terminal.
    """
    if text.isprintable():
        return shlex.quote(text)
    escaped = []
    for ch in text:
        if ch in "\\'":
            escaped.append("\\" + ch)
        elif ch.isprintable():
            escaped.append(ch)
        elif ord(ch) < 0x80:  # bash reads \xHH as a byte: only ASCII is its own character
            escaped.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            escaped.append(f"\\u{ord(ch):04x}")
        else:
            escaped.append(f"\\U{ord(ch):08x}")
    return "$'" + "".join(escaped) + "'"


def show_fields(info: LockInfo, now: datetime) -> list[tuple[str, str]]:
    """What ``locks show`` prints of a lease: backend and name, then token, times, holder."""
    fields = [
        ("backend", info.backend),
        ("name", info.name),
        ("token", str(info.token)),
        ("acquired at", info.acquired_at.isoformat()),
        ("held for", duration(held_for(info, now))),
        ("expires at", _show_expires_at(info)),
        ("expires in", duration(info.expires_in)),
    ]
    return fields + [(f"holder.{key}", _show_text(value)) for key, value in info.holder.items()]


def _show_expires_at(info: Any) -> str:
    return info.expires_at.isoformat() if info.expires_in != float("inf") else "never"


def _show_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
