"""What ``manage.py locks`` prints: JSON, tables, ``show``'s fields and shell-quoted hints.

The listing itself (who holds what, and breaking it) is the listing service,
``django_dlock.holders``, which the admin shares, with the columns both show.
Everything here is for the terminal: text that may reach it is escaped
(:func:`~django_dlock._validation.printable`, ASCII JSON, :func:`shell_quote`),
since a lock's name and its holder's metadata are anybody's text.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from itertools import islice
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from .._validation import printable
from ..backends.base import LockInfo
from ..exceptions import DLockError
from ..handler import locks
from ..holders import (
    COLUMNS,
    SLOT_COLUMNS,
    Listing,
    Slot,
    aliases,
    columns,
    duration,
    held_for,
    limit_label,
    slot_columns,
    slots_of,
)


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


def listing_json(listing: Listing) -> str:
    """``listing`` as one JSON array: the mutexes' leases, then the semaphores' rows."""
    now = listing.taken_at
    items = [as_json(info, now) for info in listing.holders]
    items += [slot_as_json(slot, now) for slot in listing.slots]
    return "[" + ",".join(items) + "]"


def listing_tables(listing: Listing, heading: Callable[[str], str]) -> list[str]:
    """The mutexes' table, then the semaphores' after a blank line; ``heading`` styles headers."""
    now = listing.taken_at
    lines: list[str] = []
    if listing.holders:
        header, *rows = table((columns(info, now) for info in listing.holders), COLUMNS)
        lines += [heading(header), *rows]
    if listing.slots:
        header, *rows = table((slot_columns(slot, now) for slot in listing.slots), SLOT_COLUMNS)
        lines += [""] if listing.holders else []
        lines += [heading(header), *rows]
    return lines


def nothing_held(listing: Listing, backend: str | None, prefix: str) -> str | None:
    """What an empty listing says: where nothing is held; None if no backend answered.

    Only the backends that answered are named: a lock table not migrated
    holds no lock, but it does not say so either.
    """
    answered = [alias for alias in aliases(backend) if alias not in listing.errors]
    if not answered:
        return None
    where = f" on backend {backend!r}" if backend else ""
    if listing.errors:
        where = f" on backend(s) {', '.join(answered)}"
    under = f" with names starting {prefix!r}" if prefix else ""
    return f"No locks held{where}{under}."


def slot_show_fields(slot: Slot, now: datetime) -> list[tuple[str, str]]:
    """What ``locks show`` prints of a semaphore's row: the name's, then its holder's."""
    sem = slot.semaphore
    fields = [
        ("backend", sem.backend),
        ("name", sem.name),
        ("kind", sem.kind),
        ("limit", limit_label(sem) or "-"),
        ("mode", slot.mode or "- (no holder)"),
        ("waiting", str(sem.waiting)),
        ("parked", str(sem.parked)),
    ]
    if slot.lease is not None:
        fields += show_fields(slot.lease, now)[2:]
    return fields


#: The columns of ``manage.py locks check``.
CHECK_COLUMNS = ("BACKEND", "CLASS", "SERVER", "ROUND TRIP", "STATUS")


def check_table(results: list[dict[str, Any]]) -> list[str]:
    """``locks check``'s table, a row per result in order; the header is the first line."""
    rows = []
    for r in results:
        if r["ok"]:
            state = "ok" + (f", {len(r['warnings'])} warning(s)" if r["warnings"] else "")
            rows.append(
                (r["backend"], r["class"], r["version"], f"{r['latency_ms']:.1f} ms", state)
            )
        else:
            rows.append((r["backend"], r["class"], "-", "-", "FAILED"))
    return table(rows, CHECK_COLUMNS)
