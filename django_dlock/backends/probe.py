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

from typing import TYPE_CHECKING

from .._validation import INTERNAL_PREFIX, holder_metadata, new_owner
from ..exceptions import BackendUnavailable, LockInTransaction

if TYPE_CHECKING:
    from .base import BaseLockBackend

#: The one name each backend's probe takes and releases.
PROBE_NAME = f"{INTERNAL_PREFIX}probe"
#: Seconds the probe's lease lasts when its release does not arrive.
PROBE_TTL = 10.0


def probe(backend: BaseLockBackend) -> None:
    """Take and release the probe's lease; ``BackendUnavailable`` saying which step failed."""
    from .sql import Busy

    owner = new_owner()
    holder = holder_metadata(PROBE_TTL, {"probe": True})[1]
    try:
        granted = backend.do_acquire(PROBE_NAME, owner, PROBE_TTL, holder, False)
    except (Busy, LockInTransaction):
        # SQLite's write lock was held, or (inside a caller's atomic block)
        # another probe held the name: the database answered.
        return
    except BackendUnavailable as e:
        raise BackendUnavailable(
            f"Lock backend {backend.alias!r} answered its ping, but no lock can be taken on "
            f"it: {e}",
            backend=backend.alias,
            transient=e.transient,
        ) from e
    if granted is None:
        return  # another probe holds it this moment: the acquisition ran
    try:
        backend.do_release(PROBE_NAME, owner)
    except (Busy, BackendUnavailable) as e:
        raise BackendUnavailable(
            f"Lock backend {backend.alias!r} granted the probe's lease but could not release "
            f"it (it ends within {PROBE_TTL:g} s): {e}",
            backend=backend.alias,
            transient=getattr(e, "transient", True),
        ) from e
