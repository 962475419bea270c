"""Holding a lock until the transaction ends (``lock(..., release_on_commit=True)``, views).

Which transaction: the one the protected writes are in: the database
``using`` names, or else the one database whose connection is inside
``atomic()`` in this thread. With several open, a database backend whose own
database is one of them holds the lock to the end of them all; otherwise
nothing can choose between them, and :class:`AmbiguousTransaction` is
raised, never a silent release before the commit. Guarded views hold their lock until every
transaction open around them has ended (:func:`release_at_transactions_end`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from django.db.transaction import TransactionManagementError

from .commit_hooks import on_commit_first
from .exceptions import LockLost
from .held import HeldLock
from .watchdog import get_watchdog

__all__ = ["AmbiguousTransaction"]

if TYPE_CHECKING:
    from .backends.protocol import LockService as BaseLockBackend


class AmbiguousTransaction(TransactionManagementError):
    """``release_on_commit`` cannot tell which open transaction the lock must outlive.

    Raised where the lock would be released, naming the databases; the lock is
    released then (the block is left with this error), and the transaction
    rolls back unless the caller catches it.
    """


class _Countdown:
    """Releases ``held`` once each of ``count`` transactions has committed or rolled back.

    After a rollback the release runs off Django's connections (see
    :class:`_ReleaseAtCommit`).
    """

    def __init__(self, held: HeldLock, count: int) -> None:
        self.held = held
        self.left = count
        self.rolled_back = False
        self._mutex = threading.Lock()

    def ended(self, committed: bool) -> None:
        with self._mutex:
            self.left -= 1
            self.rolled_back |= not committed
            if self.left:
                return
        if self.rolled_back:
            _off_django_connections(self.held.backend, self.held.release_quietly)
        else:
            self.held.release_quietly()


class _ReleaseAtCommit:
    """An ``on_commit`` callback that counts a commit; freeing it uncalled counts a rollback.

    Django drops the callbacks of a transaction, or of a savepoint, that rolls
    back; CPython frees the dropped callback at once (reference counting),
    and its finalizer counts the rollback then. That happens inside Django's
    rollback, before the connection is back in autocommit, so for a backend
    whose statements run on Django's connections (the database backend) the
    release is handed to the backend's renewal thread, which uses a
    connection of its own.
    """

    def __init__(self, countdown: _Countdown) -> None:
        self.countdown = countdown
        self._finalizer = weakref.finalize(self, countdown.ended, False)
        self._finalizer.atexit = False

    def __call__(self) -> None:
        self._finalizer.detach()
        self.countdown.ended(True)


def _off_django_connections(backend: BaseLockBackend, call: Callable[[], object]) -> None:
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


def _in_atomic(connection: Any) -> bool:
    """Inside ``atomic()``, other than the ones Django's TestCase opens and never commits."""
    return connection.in_atomic_block and not all(
        getattr(block, "_from_testcase", False) for block in connection.atomic_blocks
    )


def _in_transaction(connection: Any) -> bool:
    """Inside a transaction that will commit: ``atomic()`` not nested in a TestCase's.

    Django's ``TestCase`` wraps each test in a transaction that never commits,
    so an ``atomic()`` inside it is a savepoint whose ``on_commit`` callbacks
    never run. A lock held to that commit would be held to the end of the
    test, and the test's second request to the same view, or second call of
    the same code, would find it held. There, as with no transaction, the
    lock is released when its block is left.
    """
    return connection.in_atomic_block and not getattr(
        connection.atomic_blocks[0], "_from_testcase", False
    )


def open_transactions() -> list[str]:
    """The database aliases whose connection in this thread is inside a transaction that commits.

    Django's TestCase transactions, and ``atomic()`` blocks inside them, do
    not count: they never commit (see :func:`_in_transaction`).
    """
    from django.db import connections

    return sorted(c.alias for c in connections.all(initialized_only=True) if _in_transaction(c))


def _user_transactions() -> list[str]:
    """The aliases whose connection is inside an ``atomic()`` of the code's own.

    Unlike :func:`open_transactions`, an ``atomic()`` inside a TestCase's
    counts: the choice between databases must come out the same in a test
    as in production, or a test passes what production refuses.
    """
    from django.db import connections

    return sorted(c.alias for c in connections.all(initialized_only=True) if _in_atomic(c))


def _lock_database(backend: BaseLockBackend) -> str | None:
    """The DATABASES alias the database backend keeps its leases in; None for other backends."""
    if not backend.uses_django_connections:
        return None
    database = getattr(backend, "database", None)
    return database if isinstance(database, str) else None


def transactions_to_outlive(
    backend: BaseLockBackend, using: str | None = None, *, name: str | None = None
) -> list[str]:
    """The aliases whose open transactions a lock on ``backend`` must outlive; [] if none.

    ``using`` names the database the protected writes go to; when a
    transaction is open elsewhere but not there, that is a mistake, and
    :class:`AmbiguousTransaction` says so. Without ``using``: the one
    database inside ``atomic()``. With several open, a database backend
    whose own database is one of them outlives them all (its lease is in
    one of them, and the writes may be in another, which may commit later);
    any other backend raises :class:`AmbiguousTransaction`. Inside a
    TestCase, whose transaction never commits, the choice is made the same
    way, then left out: the lock is released with its block.
    """
    from django.db import transaction

    open_ = _user_transactions()
    what = f"release_on_commit of lock {name!r}" if name else "release_on_commit"
    if using is not None:
        if open_ and using not in open_:
            raise AmbiguousTransaction(
                f"{what}: using={using!r}, but no transaction is open on {using!r}, while one "
                f"is on {_names(open_)}. Pass the alias of the transaction to hold the lock "
                f"to, using={open_[0]!r} say, or leave the transaction before releasing."
            )
        chosen = [using] if using in open_ else []
    elif len(open_) > 1 and _lock_database(backend) not in open_:
        raise AmbiguousTransaction(
            f"{what}: transactions are open on {_names(open_)}; pass using= to name the one "
            "the lock must be held to the end of (the one the protected writes go to)."
        )
    else:
        chosen = open_
    return [a for a in chosen if _in_transaction(transaction.get_connection(a))]


def _names(aliases: Sequence[str]) -> str:
    return " and ".join(repr(a) for a in aliases)


def _confirm(held: HeldLock) -> None:
    """Raise ``LockLost`` (and release) if the lease was lost, as leaving a block would."""
    try:
        held.ensure()
    except LockLost:
        held.release_quietly()
        raise


def release_at_transactions_end(
    held: HeldLock, aliases: Sequence[str], *, body_raised: bool = True
) -> bool:
    """Release ``held`` once the transactions open on all of ``aliases`` have ended.

    The aliases not inside a transaction (TestCase's aside) are left out;
    False, and nothing done, if that leaves none. Unless ``body_raised``,
    the lease is confirmed first: ``LockLost`` if it was lost meanwhile, so
    that the transactions, whose work was not protected to the end, can roll
    back. Works for any handle: a mutex's lease or a semaphore's slot.
    """
    from django.db import transaction

    open_ = [a for a in dict.fromkeys(aliases) if _in_transaction(transaction.get_connection(a))]
    if not open_:
        return False
    if not body_raised:
        _confirm(held)
    countdown = _Countdown(held, len(open_))
    for alias in open_:
        # First and robust: a failing hook of the application must not skip it.
        on_commit_first(transaction.get_connection(alias), _ReleaseAtCommit(countdown))
    return True


def on_rollback(backend: BaseLockBackend, callback: Callable[[], None], using: str) -> bool:
    """Call ``callback`` if the transaction open on ``using`` rolls back; False if none is open.

    On ``backend``'s renewal thread when it uses Django's connections (the
    rollback is under way on this one), else at once.
    """
    from django.db import transaction

    if not _in_atomic(transaction.get_connection(using)):
        return False
    # First: freed uncalled behind a failing hook of the application, it
    # would take a committed transaction for a rollback.
    on_commit_first(transaction.get_connection(using), _OnRollback(backend, callback))
    return True


def release_at_transaction_end(
    held: HeldLock,
    using: str | None = None,
    *,
    body_raised: bool = True,
    strict: bool = False,
) -> bool:
    """Release ``held`` when the transaction it must outlive ends; False if none is open.

    With ``using``, the transaction open on that database, if any: the
    writes went there, and outside a transaction they are committed already.
    With ``strict`` (``lock(..., using=...)``), naming a database with no
    transaction while another has one raises :class:`AmbiguousTransaction`.
    Without ``using``, see :func:`transactions_to_outlive`. Unless
    ``body_raised``, the lease is confirmed first, as a release would:
    ``LockLost`` if it was lost inside the block, so that the transaction,
    whose work was not protected to the end, can roll back. When the body
    raised, an ambiguous case holds the lock to the end of every open
    transaction rather than hide the body's error.
    """
    if using is None or strict:
        try:
            aliases = transactions_to_outlive(held.backend, using, name=held.name)
        except AmbiguousTransaction:
            if body_raised:
                # The body's error matters more than this one: hold the lock
                # to the end of every open transaction instead.
                return release_at_transactions_end(held, open_transactions())
            held.release_quietly()
            raise
    else:
        aliases = [using]
    return release_at_transactions_end(held, aliases, body_raised=body_raised)
