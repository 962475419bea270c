"""Holding a lock until the transaction ends (``lock(..., release_on_commit=True)``)."""

from __future__ import annotations

import weakref

from .exceptions import LockLost
from .handle import HeldLock
from .watchdog import get_watchdog


class _ReleaseAtCommit:
    """An ``on_commit`` callback that releases; freeing it uncalled (a rollback) releases too.

    Django drops the callbacks of a transaction, or of a savepoint, that rolls
    back; CPython frees the dropped callback at once (reference counting),
    and its finalizer releases the lock then. That happens inside Django's
    rollback, before the connection is back in autocommit, so for a backend
    whose statements run on Django's connections (the database backend) the
    finalizer hands the release to the backend's renewal thread, which uses
    a connection of its own.
    """

    def __init__(self, held: HeldLock) -> None:
        self.held = held
        self._finalizer = weakref.finalize(self, _release_elsewhere, held)
        self._finalizer.atexit = False

    def __call__(self) -> None:
        self._finalizer.detach()
        self.held.release_quietly()


def _release_elsewhere(held: HeldLock) -> None:
    if held.backend.uses_django_connections:
        get_watchdog().renewer(held.alias).submit(held.release_quietly)
    else:
        held.release_quietly()


def release_at_transaction_end(
    held: HeldLock, using: str | None = None, *, body_raised: bool = True
) -> bool:
    """Release ``held`` when the transaction of ``using`` ends; False if none is open.

    Unless ``body_raised``, the lease is confirmed first, as a release would:
    ``LockLost`` if it was lost inside the block, so that the transaction,
    whose work was not protected to the end, can roll back.
    """
    from django.db import DEFAULT_DB_ALIAS, transaction

    db = using or DEFAULT_DB_ALIAS
    connection = transaction.get_connection(db)
    if not connection.in_atomic_block or all(
        # Django's TestCase wraps each test in transactions that never commit:
        # code with no atomic() of its own releases at once, as in production.
        getattr(block, "_from_testcase", False)
        for block in connection.atomic_blocks
    ):
        return False
    if not body_raised:
        try:
            held.ensure()
        except LockLost:
            held.release_quietly()
            raise
    transaction.on_commit(_ReleaseAtCommit(held), using=db)
    return True
