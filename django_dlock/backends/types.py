"""What backends return: a :class:`Grant`, a :class:`LockInfo`, a :class:`ServerStatus`.

And :func:`extend_each`, ``do_extend_many`` for a backend that renews one lease a call;
:class:`BoundElsewhere`, a lease this thread cannot reach now; and :class:`Busy`, a
statement the database refused for contention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..exceptions import BackendUnavailable


class BoundElsewhere(BackendUnavailable):
    """The lease lives in a transaction of another thread's, which only that thread may use.

    The database backend on SQLite, for a lease taken inside
    ``transaction.atomic()``: until that transaction ends, its renewal is put
    off (the renewal thread tries again, and no other connection can take the
    lease meanwhile: SQLite has one writer) and a release from another thread
    runs when it ends.
    """


class Busy(Exception):
    """The database refused the statement for contention; the attempt may be repeated.

    The database backend raises it; the probe behind ``ping()`` counts it a refusal.
    """


@dataclass(frozen=True)
class Grant:
    """A lease whose start the backend knows better than "when the attempt was sent".

    ``expires`` is a ``time.monotonic()`` instant no later than the lease's
    end, and ``lease`` its length in seconds (it may be shorter than the TTL
    asked for; the watchdog then extends it).
    """

    token: int
    expires: float
    lease: float


@dataclass(frozen=True)
class LockInfo:
    """One live lease, as listed by ``locks[alias].list()``.

    ``acquired_at`` and ``expires_at`` come from the lock service's clock;
    ``expires_in`` is the seconds left by that clock when the list was taken.
    ``holder_json`` is the stored text ``holder`` was parsed from, when the
    backend has it: ``manage.py locks --json`` copies it instead of encoding
    ``holder`` again.
    """

    backend: str
    name: str
    token: int
    holder: dict[str, Any] = field(hash=False)
    acquired_at: datetime
    expires_at: datetime
    expires_in: float
    holder_json: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ServerStatus:
    """What ``locks[alias].ping()`` found: the service answered in ``latency`` seconds.

    ``warnings`` name the parts of it that did not answer although it can
    still lock (a Redlock master that is down).
    """

    backend: str
    version: str
    latency: float
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class SlotEntry:
    """One holder (``info`` is its lease) or waiter (``info`` is None) of a semaphore.

    What a backend's ``do_list_slots`` returns; ``weight`` is 1 for a
    semaphore's holder or a reader, ``limit`` for a writer.
    """

    name: str
    limit: int
    weight: int
    info: LockInfo | None


@dataclass(frozen=True)
class SemaphoreInfo:
    """A semaphore or read/write lock with live holders, waiters or parked tasks.

    ``kind`` is "semaphore" or "rwlock"; ``holders`` are their leases by
    fencing token, and ``modes`` says for each whether it holds a "slot",
    "read" or "write". ``waiting`` counts the acquisitions waiting now (on
    backends that record them), ``parked`` the Celery tasks parked by
    ``on_locked="defer"``.
    """

    backend: str
    name: str
    kind: str
    limit: int
    holders: tuple[LockInfo, ...]
    modes: tuple[str, ...]
    waiting: int = 0
    parked: int = 0


@dataclass(frozen=True)
class ParkedTask:
    """A Celery task parked on a full semaphore, as ``do_list_parked`` returns it.

    ``key`` identifies it (the task id), ``order`` is its place in the queue
    (smaller first) and ``payload`` the JSON text that re-enqueues it.
    """

    name: str
    key: str
    order: int
    payload: str


def extend_each(
    extend: Callable[[str, str, float], bool], leases: Sequence[tuple[str, str, float]]
) -> list[bool | Exception]:
    """``do_extend_many`` one lease at a time: what a backend without batches does."""
    results: list[bool | Exception] = []
    for name, owner, ttl in leases:
        try:
            results.append(extend(name, owner, ttl))
        except Exception as e:
            results.append(e)
    return results
