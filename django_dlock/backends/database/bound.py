"""Leases taken inside ``transaction.atomic()`` on SQLite: bound to the caller's connection.

A mixin of :class:`~.backend.DatabaseBackend` (the package's docstring says
why): the lease lives in the caller's transaction until it ends, and only the
thread that took it uses that connection. Renewals asked for on other threads
are put off to the commit, releases to the transaction's end; a rollback
reports the lease lost at once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db.backends.base.base import BaseDatabaseWrapper

from ...commit_hooks import at_transaction_end, on_commit_first
from ..offload import Offload
from ..types import BoundElsewhere

logger = logging.getLogger("django_dlock")

#: How long another thread waits, seconds, for a lease renewed at its commit
#: to be unbound by the next commit hook on the owner's thread.
UNBIND_WAIT = 1.0


class BoundLeases:
    """The bound leases of one database backend."""

    if TYPE_CHECKING:  # the backend's, which this class is mixed into
        alias: str
        offload: Offload

    def _init_bound(self) -> None:
        # owner token -> the SQLite connection whose open transaction holds the
        # lease, and the thread that took it there (the only one that may use it)
        self._bound: dict[str, tuple[BaseDatabaseWrapper, int]] = {}
        # owner token -> its release, asked for on another thread while bound:
        # run once the transaction has ended
        self._release_at_end: dict[str, Callable[[], Any]] = {}
        # owner token -> its renewal, put off while bound: run at the commit
        self._renew_at_commit: dict[str, tuple[str, Callable[[], bool]]] = {}
        # owners whose transaction committed (its commit hook ran), until it ends
        self._settled: set[str] = set()
        self._binding = threading.Lock()

    def _bind(self, owner: str, connection: BaseDatabaseWrapper) -> None:
        with self._binding:
            self._bound[owner] = connection, threading.get_ident()
        # Bound until the transaction ends (a lease handed over as a ticket is
        # never released here, and must not stay in the map for ever).
        at_transaction_end(connection, functools.partial(self._ended, owner))
        # Registered after: runs before the unbinding, and only at a commit.
        on_commit_first(connection, functools.partial(self._settle, owner))

    def _bound_here(self, owner: str) -> BaseDatabaseWrapper | None:
        """The connection ``owner``'s lease is bound to, if its transaction is still open.

        Only the thread that took the lease may use it. CPython's sqlite3
        binds a statement's parameters holding the GIL and waiting for the
        connection's mutex, while a statement running on the same connection
        holds that mutex and waits for the GIL to call a Python function
        (our clock, Django's date functions): a renewal thread sharing the
        caller's connection deadlocked the two threads for good.
        """
        bound = self._bound.get(owner)
        if bound is None:
            return None
        connection, thread = bound
        if not connection.in_atomic_block:
            self._unbind(owner)
            return None
        if thread == threading.get_ident():
            with self._binding:
                owed = self._renew_at_commit.get(owner)
            # The renewals put off, here first, so that the row is current; and
            # again at the commit (a savepoint rolled back may undo this one).
            if owed is not None:
                owed[1]()
            return connection
        raise BoundElsewhere(
            f"The lease of {owner!r} on backend {self.alias!r} was taken inside "
            "transaction.atomic() on SQLite and lives in that transaction: only the "
            "thread that took it can reach it until the transaction ends",
            backend=self.alias,
        )

    def _ended(self, owner: str) -> None:
        """The transaction the lease was bound in has committed or rolled back."""
        with self._binding:
            committed = owner in self._settled
            self._settled.discard(owner)
            rolled_back = not committed and owner in self._bound
        self._unbind(owner)
        if rolled_back:
            # The row taken in it is gone with it: tell the handle now, not at
            # its next renewal (meanwhile another process may take the lock).
            # Inside Django's rollback: no statement runs here.
            self._tell_lost(owner, "the transaction it was taken in rolled back")

    def _tell_lost(self, owner: str, reason: str) -> None:
        from ...watchdog import get_watchdog  # the watchdog sits above the backends

        for held in get_watchdog().scheduled(self.alias):
            if held.owner == owner:
                held.lost_on_server(reason)

    def _unbind(self, owner: str) -> None:
        with self._binding:
            self._bound.pop(owner, None)
            self._renew_at_commit.pop(owner, None)
            pending = self._release_at_end.pop(owner, None)
        if pending is not None:
            # The transaction has ended: on Django's rollback path, inside it.
            # Another thread, on a connection of its own, runs the release (a
            # no-op if the transaction rolled the lease back).
            self.offload.submit("ops", pending)

    def _renew_elsewhere(self, name: str, owner: str, renew: Callable[[], bool]) -> bool:
        """Whether the renewal of a lease bound on another thread was put off to the commit.

        While the transaction that took it is open no other connection can
        take the lease (SQLite has one writer, and that transaction holds the
        write lock), so the renewal counts as granted; the row is renewed on
        the owner's thread as the transaction commits (:meth:`_settle`).
        """
        return self._put_off(self._renew_at_commit, owner, (name, renew))

    def _settle(self, owner: str) -> None:
        """At the commit, on the owner's thread: run the renewal put off, or tell the handle."""
        with self._binding:
            self._settled.add(owner)
            owed = self._renew_at_commit.pop(owner, None)
        if owed is None:
            return
        name, renew = owed
        try:
            if renew():
                return
        except Exception:
            logger.warning("Renewing %r on %r after its transaction failed", name, self.alias)
            return  # the renewal thread tries again, and judges
        self._tell_lost(owner, "its lease ran out while its transaction was open")

    def _release_elsewhere(self, owner: str, release: Callable[[], Any]) -> bool:
        """Whether the release of a lease bound on another thread was put off to its end.

        The release of a lease taken inside a transaction on SQLite, asked for
        on another thread (a savepoint's rollback hands it to the renewal
        thread): the lease is in that transaction, which the other thread
        cannot touch. A rollback has undone it already; otherwise it is
        released as soon as the transaction ends, and until then no other
        connection can take it (SQLite has one writer).
        """
        return self._put_off(self._release_at_end, owner, release)

    def _put_off(self, store: dict[str, Any], owner: str, work: Any) -> bool:
        """Keep ``work`` in ``store`` if ``owner``'s lease is bound on another thread, open.

        Also while its transaction is ending, until the commit's renewal has
        run (:meth:`_settle`, the first commit hook): a COMMIT can take a
        while (an fsync), and racing it this thread unbound the lease, dropped
        the renewal owed and found the row expired, while the handle counted
        on it. The handle is told at the end if the renewal fails or the
        transaction rolled back.
        """
        with self._binding:
            bound = self._bound.get(owner)
            if bound is None or bound[1] == threading.get_ident():
                return False
            if bound[0].in_atomic_block or owner not in self._settled:
                store[owner] = work
                return True
        # Renewed at the commit, and about to be unbound (the next hook, on
        # the owner's thread): wait for it, then go on as usual.
        deadline = time.monotonic() + UNBIND_WAIT
        while owner in self._bound and time.monotonic() < deadline:
            time.sleep(0.001)
        return False
