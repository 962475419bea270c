"""Holding a lock until the transaction ends (``lock(..., release_on_commit=True)``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .exceptions import LockLost
from .handle import HeldLock
from .watchdog import get_watchdog

if TYPE_CHECKING:
    from .backends.base import BaseLockBackend


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
    _off_django_connections(held.backend, held.release_quietly)


def _off_django_connections(backend: BaseLockBackend, call: Callable[[], None]) -> None:
    """``call`` now, or on ``backend``'s renewal thread if it uses Django's connections."""
    if backend.uses_django_connections:
        get_watchdog().renewer(backend.alias).submit(call)
    else:
        call()


class _OnRollback:
    """An ``on_commit`` callback that does nothing; freed uncalled (a rollback), it calls back."""

    def __init__(self, backend: BaseLockBackend, callback: Callable[[], None]) -> None:
        self._finalizer = weakref.finalize(self, _off_django_connections, backend, callback)
        self._finalizer.atexit = False

    def __call__(self) -> None:
        self._finalizer.detach()


def _in_transaction(connection: Any) -> bool:
    """Inside ``atomic()``, other than the ones Django's TestCase opens and never commits."""
    return connection.in_atomic_block and not all(
        getattr(block, "_from_testcase", False) for block in connection.atomic_blocks
    )


def on_rollback(backend: BaseLockBackend, callback: Callable[[], None], using: str) -> bool:
    """Call ``callback`` if the transaction open on ``using`` rolls back; False if none is open.

    On ``backend``'s renewal thread when it uses Django's connections (the
    rollback is under way on this one), else at once.
    """
    from django.db import transaction

    if not _in_transaction(transaction.get_connection(using)):
        return False
    transaction.on_commit(_OnRollback(backend, callback), using=using)
    return True


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
    # Django's TestCase wraps each test in transactions that never commit:
    # code with no atomic() of its own releases at once, as in production.
    if not _in_transaction(transaction.get_connection(db)):
        return False
    if not body_raised:
        try:
            held.ensure()
        except LockLost:
            held.release_quietly()
            raise
    transaction.on_commit(_ReleaseAtCommit(held), using=db)
    return True
