"""The probe behind ``ping()``: proof that a lock can be taken, not only that the server answers.

A server that tells its version may still refuse every acquisition: the lock
table not migrated, a Redis user denied the lock scripts (``NOPERM``), a
read-only replica, an etcd user who may not write the key prefix. So
``ping()`` (and with it ``manage.py locks check`` and the health check)
also takes a lease on one internal name per backend, :data:`PROBE_NAME`,
through the primitive that ``acquire()`` uses (the same script, the same
statements), and releases it: two round trips after the version's.

The name starts with ``INTERNAL_PREFIX``, which no lock name may: no process
can hold it through the API, and listings leave it out. Two probes at the
same moment (two processes) may meet there; the one that finds it held has
still run the acquisition and been answered, which is what it proves.
The lease lasts :data:`PROBE_TTL` seconds if its release is lost.

What it does not prove: on Redis Cluster, that every shard can lock (the
name lives on one); semaphores and parked calls (their own scripts and
tables, which a migration or ACL could still leave out).
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from .._validation import INTERNAL_PREFIX, holder_metadata, new_owner
from ..exceptions import BackendUnavailable, LockInTransaction
from .types import Busy

if TYPE_CHECKING:
    from .protocol import LockService as BaseLockBackend

#: The one name each backend's probe takes and releases.
PROBE_NAME = f"{INTERNAL_PREFIX}probe"
#: Seconds the probe's lease lasts when its release does not arrive.
PROBE_TTL = 10.0
#: Seconds of refusals, with nobody holding the name, after which the probe fails.
REFUSED_FOR = 1.0


def probe(backend: BaseLockBackend) -> None:
    """Take and release the probe's lease; ``BackendUnavailable`` saying which step failed."""
    owner = new_owner()
    holder = holder_metadata(PROBE_TTL, {"probe": True})[1]
    deadline = time.monotonic() + REFUSED_FOR
    while not _granted(backend, owner, holder):
        if _held_by_another_probe(backend):
            return  # the acquisition ran and was answered: that is what is proved
        # Refused with nobody holding the name: another probe's lease came and
        # went between the two calls (probes at the same moment), or the
        # service refuses while nobody holds it (a database kept busy by
        # another connection's write lock). Only the second lasts.
        if time.monotonic() > deadline:
            raise _cannot_lock(
                backend,
                f"it refused the probe's lease for {REFUSED_FOR:g} s while nobody held it "
                "(a database refuses so while another connection holds its write lock, or "
                "a lock on the lock table, for longer than the backend waits)",
            )
        time.sleep(random.uniform(0.01, 0.05))
    try:
        backend.do_release(PROBE_NAME, owner)
    except (Busy, BackendUnavailable) as e:
        raise BackendUnavailable(
            f"Lock backend {backend.alias!r} granted the probe's lease but could not release "
            f"it (it ends within {PROBE_TTL:g} s): {e or type(e).__name__}{advice(e)}",
            backend=backend.alias,
            transient=getattr(e, "transient", True),
        ) from e


def _granted(backend: BaseLockBackend, owner: str, holder: str) -> bool:
    try:
        return backend.do_acquire(PROBE_NAME, owner, PROBE_TTL, holder, False) is not None
    except (Busy, LockInTransaction):
        return False  # the database was busy, or (in an atomic block) the name held
    except BackendUnavailable as e:
        raise _cannot_lock(backend, f"{e}{advice(e)}", e.transient) from e


def _held_by_another_probe(backend: BaseLockBackend) -> bool:
    try:
        return backend.do_get(PROBE_NAME) is not None
    except (Busy, BackendUnavailable) as e:
        raise _cannot_lock(
            backend, f"the probe's lease could not be looked up: {e or 'busy'}{advice(e)}"
        ) from e


def _cannot_lock(backend: BaseLockBackend, why: str, transient: bool = True) -> BackendUnavailable:
    return BackendUnavailable(
        f"Lock backend {backend.alias!r} answered its ping, but no lock can be taken on it: {why}",
        backend=backend.alias,
        transient=transient,
    )


#: What to do, by what the server said (matched without case).
_ADVICE = (
    (
        ("noperm", "no permissions to run", "no permissions to access"),
        "The Redis user may not run the lock scripts: its ACL needs +@scripting "
        "(EVALSHA, EVAL, SCRIPT), the keys under the backend's KEY_PREFIX and its "
        "channels (&*).",
    ),
    (
        ("readonly you can't write", "read only replica"),
        "LOCATION is a read-only Redis replica: point it at the primary.",
    ),
    (
        ("read-only transaction", "read only transaction", "--read-only", "read-only mode"),
        "The database is read-only for this connection (a replica, or "
        "default_transaction_read_only): point the backend's database at a writable primary.",
    ),
    (
        ("attempt to write a readonly database",),
        "The SQLite file, or its directory, is not writable by this process.",
    ),
    (
        ("permission denied for", "command denied to user"),
        "The database user may not write the lock table: GRANT SELECT, INSERT, UPDATE, "
        "DELETE on django_dlock_lease to it.",
    ),
    (
        ("permission_denied", "permission denied"),
        "The etcd user needs read-write on the backend's key prefix and on dlock-epochs/.",
    ),
)


def advice(error: BaseException) -> str:
    """`` (What to do.)`` for an error whose cause the probe recognises; else ""."""
    text = f"{error} {error.__cause__ or ''}".lower()
    for needles, what in _ADVICE:
        if any(needle in text for needle in needles):
            return f" ({what})"
    return ""
