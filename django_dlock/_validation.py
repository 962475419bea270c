"""Argument checks and holder metadata, shared by the lock handle and the backends."""

from __future__ import annotations

import itertools
import json
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timezone
from typing import Any, Protocol, TypeVar


class _Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=_Named)

# One encoder: json.dumps() with non-default arguments builds a new one per call.
# NaN and infinities are refused: JSON has no such numbers, and one of them in
# a holder's metadata made ``manage.py locks --json`` an invalid document.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)

#: Names that start with this are django-dlock's own (the watchdog's lag notes,
#: the probe's lease): no lock name may start with it, so that no process can
#: take, fake or break them through the API, and listings leave them out. The
#: unit separator (U+001F) starts no name a person would choose.
INTERNAL_PREFIX = "\x1fdlock:"
_HOST = socket.gethostname()


class _Owners:
    """Owner tokens: a random per-process prefix and a counter.

    Unique without a system call per acquisition; a forked child draws a new
    prefix so that it never repeats its parent's tokens.
    """

    def __init__(self) -> None:
        self.prefix = secrets.token_hex(10)
        self.counter = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):012x}"


_owners = _Owners()


def _reset_owners_after_fork() -> None:
    global _owners
    _owners = _Owners()


os.register_at_fork(after_in_child=_reset_owners_after_fork)


def new_owner() -> str:
    """A 32-character token that identifies one acquisition."""
    return _owners.next()


def micros_to_datetime(micros: int) -> datetime:
    """An aware UTC datetime from microseconds since the epoch (a lease's stored time)."""
    return datetime.fromtimestamp(micros / 1_000_000, tz=timezone.utc)


def validate_name(name: object, *, what: str = "A lock name") -> str:
    """A non-empty str that every lock service can store as it is.

    Refused, with the same ValueError on every backend: a NUL character
    (PostgreSQL text cannot hold it; C clients cut the string there) and lone
    surrogates (not encodable as UTF-8, so no two services would agree on the
    bytes).
    """
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, not {type(name).__name__}.")
    if not name and what == "A lock name":
        raise ValueError("A lock name must not be empty.")
    if "\x00" in name:
        raise ValueError(f"{what} must not contain a NUL character: {name!r}.")
    if what == "A lock name" and name.startswith(INTERNAL_PREFIX):
        raise ValueError(
            f"Lock names starting {INTERNAL_PREFIX!r} are django-dlock's own (the watchdog's "
            f"notes, the probe's lease): {name!r}."
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} must be encodable as UTF-8; {name!r} has a lone surrogate at "
            f"position {e.start}."
        ) from None
    return name


def without_internal(leases: Iterable[T], prefix: str) -> Iterator[T]:
    """``leases`` (each with a ``name``) without django-dlock's own, unless ``prefix`` asks."""
    if prefix.startswith(INTERNAL_PREFIX):
        return iter(leases)
    return (info for info in leases if not info.name.startswith(INTERNAL_PREFIX))


def printable(text: str) -> str:
    """``text`` with control characters escaped, so a name cannot drive the terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def validate_ttl(ttl: object, *, what: str = "ttl") -> float:
    """A lease length in seconds: a finite number of at least one millisecond."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(ttl).__name__}.")
    if not math.isfinite(ttl) or ttl < 0.001:
        raise ValueError(
            f"{what} must be a finite number of seconds of at least 0.001, not {ttl!r}; "
            "leases always expire."
        )
    return float(ttl)


def validate_timeout(timeout: object) -> float | None:
    """None waits forever, 0 tries once, a positive number waits that many seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be None or a number of seconds, not {timeout!r}.")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, not {timeout!r}.")
    return None if math.isinf(timeout) else float(timeout)


def dump_holder(holder: Mapping[str, Any]) -> str:
    try:
        return _ENCODER.encode(holder)
    except (TypeError, ValueError) as e:
        raise TypeError(f"Lock metadata must be JSON-serializable: {e}") from e


def load_holder(text: str | None) -> dict[str, Any]:
    """The holder metadata stored as ``text`` (the JSON ``do_acquire`` got); {} for none."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"unparsed": text}
    return value if isinstance(value, dict) else {"value": value}


def load_holders(texts: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """``[load_holder(t) for t in texts]``, and whether each text is its holder's JSON.

    They are parsed as one JSON array when they all are JSON objects: one
    parse of a large list costs a fraction of one parse per holder
    (``manage.py locks`` lists 100,000). Then ``texts[i]`` is the JSON of
    exactly ``result[i]``, and the second value is True; otherwise each text
    is parsed alone, as ``load_holder`` does, and it is False.

    The texts are written by ``dump_holder``, one JSON object each. A set of
    texts crafted to split and rejoin across the commas (only someone who can
    write the lock service's keys directly could store them) could pair a
    lease with another's metadata in a listing; it cannot change a lease.
    """
    if not texts:
        return [], True
    try:
        values = json.loads(f"[{','.join(texts)}]")
    except ValueError:
        values = None
    if values is None or len(values) != len(texts) or not all(type(v) is dict for v in values):
        # A text that was not one JSON object ("", "1,2", a list) made the
        # array invalid or different; read each alone.
        return [load_holder(text) for text in texts], False
    return values, True


def holder_metadata(ttl: float, extra: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """Who is asking, as a dict and as the JSON stored with the lease.

    Without ``extra`` (the common case) the JSON is written from the same
    values directly: the encoder costs more than the rest of this function.
    """
    pid = os.getpid()
    thread = threading.current_thread().name
    acquired_at = _now_iso()
    holder: dict[str, Any] = {
        "host": _HOST,
        "pid": pid,
        "thread": thread,
        "acquired_at": acquired_at,
        "ttl": ttl,
    }
    if extra:
        holder.update(extra)
        return holder, dump_holder(holder)
    text = (
        f'{{"host":{_HOST_JSON},"pid":{pid},"thread":{_ENCODER.encode(thread)},'
        f'"acquired_at":"{acquired_at}","ttl":{float(ttl)!r}}}'
    )
    return holder, text


_HOST_JSON = _ENCODER.encode(_HOST)

# The current second as "YYYY-MM-DDTHH:MM:SS" (UTC), written once per second.
_second: tuple[int, str] = (-1, "")


def _now_iso() -> str:
    """``datetime.now(timezone.utc).isoformat(timespec="milliseconds")``, for a third of its cost.

    Only the milliseconds are formatted on each call; the date and time of
    day once per second.
    """
    global _second
    now = time.time()
    second = int(now)
    cached = _second
    if cached[0] != second:
        cached = _second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{cached[1]}.{int((now - second) * 1000):03d}+00:00"
