"""The watchdogs' lag notes: how ``locks check`` learns that a process fell behind.

A process whose renewal thread falls behind (``renewer.Renewer``) leaves a
note on the backend: a lease named after the process, under
:data:`LAG_PREFIX`, that lasts :data:`LAG_NOTE_TTL` seconds and carries what
it saw in its holder metadata (:func:`leave_note`). ``manage.py locks
check`` lists the notes left on each backend (:func:`lag_notes`), so that
an operator sees the lag of a process other than the one they run.

The notes live under django-dlock's own names (``INTERNAL_PREFIX``), which
no lock can take, and are read as data, never trusted: anyone who can write
to the lock service can write one.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from ._validation import INTERNAL_PREFIX, holder_metadata, new_owner

if TYPE_CHECKING:
    from .backends.protocol import LockService as BaseLockBackend

logger = logging.getLogger("django_dlock")

#: Lock names under which a lagging process leaves a note for ``locks check``:
#: django-dlock's own names, which no lock can take (``INTERNAL_PREFIX``).
LAG_PREFIX = f"{INTERNAL_PREFIX}watchdog-lagging:"
#: How long that note lasts, in seconds.
LAG_NOTE_TTL = 600.0


def leave_note(
    backend: Any, alias: str, previous: str | None, detail: dict[str, Any]
) -> str | None:
    """Leave this process's note on ``backend``, in place of the one ``previous`` owns.

    ``detail`` is what the note says (``late_s``, ``waiting``, ``ran_out``).
    Returns the owner of the note now on the service: the new one's, or
    ``previous`` when it could not be left (a failure is logged, never
    raised: the renewals matter more than their report).
    """
    name = f"{LAG_PREFIX}{socket.gethostname()}:{os.getpid()}"
    try:
        if previous is not None:
            backend.do_release(name, previous)
        owner = new_owner()
        holder = holder_metadata(LAG_NOTE_TTL, {"watchdog_lag": detail})[1]
        if backend.do_acquire(name, owner, LAG_NOTE_TTL, holder, False) is not None:
            return owner
    except Exception:
        logger.warning("Could not note the lag on %r", alias, exc_info=True)
    return previous


def lag_notes(backend: BaseLockBackend) -> list[str]:
    """What ``locks check`` warns of: processes whose watchdog fell behind on ``backend``.

    Each lagging process leaves a note (a lease under ``LAG_PREFIX``) that
    lasts ``LAG_NOTE_TTL`` seconds. A note is read as data, never trusted:
    one whose metadata is not what :func:`leave_note` writes (written to the
    lock service directly) is reported as malformed, and each field is cut
    to 100 characters. The text is raw: whoever prints it escapes it.
    """
    notes = []
    for info in backend.list(LAG_PREFIX):
        holder = info.holder
        lag = holder.get("watchdog_lag") if isinstance(holder, dict) else None
        if not (
            isinstance(lag, dict)
            and isinstance(lag.get("late_s"), (int, float))
            and isinstance(holder.get("pid"), int)
            and isinstance(holder.get("host"), str)
        ):
            notes.append(f"a malformed watchdog lag note: {_field(info.name)}")
            continue
        notes.append(
            f"the watchdog of process {_field(holder.get('pid'))} on "
            f"{_field(holder.get('host'))} fell behind renewing leases at "
            f"{_field(holder.get('acquired_at'))}: renewals went out {_field(lag.get('late_s'))} "
            f"s late, {_field(lag.get('waiting'))} lease(s) waited and "
            f"{_field(lag.get('ran_out'))} ran out first (noted for {LAG_NOTE_TTL / 60:g} minutes)"
        )
    return notes


def _field(value: object) -> str:
    """A note's field as text of at most 100 characters."""
    text = value if isinstance(value, str) else repr(value)
    return text[:100] + ("..." if len(text) > 100 else "")
