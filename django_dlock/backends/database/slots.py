"""The database backend's semaphores, read/write locks and parked Celery calls.

Tables (migration 0004): ``django_dlock_slot``, one row per holder (with a
token) or waiter (without) of a semaphore, and ``django_dlock_parkedcall``.
A semaphore's fencing counter is a ``django_dlock_lease`` row of its own,
whose digest is taken over ``"slots"``, the prefix and the name: it is never
a live mutex lease, so the mutex listing never shows it, and like a mutex's
it is seeded from the server clock in microseconds and kept for ever.

An acquisition is one short transaction on the backend's connection (a
private one inside the caller's ``atomic()`` on PostgreSQL and MySQL, so that
the caller's rollback never undoes a grant nor repeats a token):

1. lock the counter row (created if missing): ``SELECT ... FOR UPDATE`` on
   PostgreSQL and MySQL, ``BEGIN IMMEDIATE`` (the write lock) on SQLite, so
   that acquisitions of one name run one at a time;
2. delete the name's rows whose leases ended by the server's clock;
3. read the rest, and grant or record a waiter as ``semaphore_backend.py`` says.

Inside the caller's ``atomic()`` on SQLite a slot joins the caller's
transaction, as the mutex does (the package's docstring): a second
connection could not commit while that transaction has read or written.
The attempt reads first and writes only if a slot is free: granted at once,
its rows written in the caller's transaction and the lease bound to that
connection until the transaction ends (renewals, checks and the release go
through it); refused at once with ``LockInTransaction`` when none is free,
having written nothing. A rollback removes the rows with the rest of the
caller's work: the next renewal, ``ensure()`` or release finds the lease
gone. On SQLite a token is ``max(counter + 1, wall clock in us)``, so the
acquisition after a rolled-back one never gets its token again.

Waiting backs off (2 ms doubling to 100 ms); waiters are not FIFO.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from ..._validation import load_holder, micros_to_datetime
from ...clocks import ms, wall_micros
from ...commit_hooks import at_transaction_end
from ...exceptions import LockInTransaction
from ..base import LockInfo, ParkedTask, SlotEntry
from ..parking_backend import ParkingBackend
from ..semaphore_backend import SemaphoreBackend
from ..types import Busy
from .sql import BINARY, IDLE_IN_TRANSACTION, SERVER_CLOCK, micros

T = TypeVar("T")

logger = logging.getLogger("django_dlock")

#: How long a release that the caller's SQLite transaction holds up is retried, s.
RELEASE_LATER_FOR = 600.0

_BEGIN = {"sqlite": "BEGIN IMMEDIATE", "mysql": "START TRANSACTION", "postgresql": "BEGIN"}
# MySQL's REPEATABLE READ would lock gaps (and deadlock racing acquirers) and
# read holders from a snapshot; each statement here wants the latest commit.
_ISOLATION = {"mysql": "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"}
_LOCK_ROW = {"sqlite": "", "mysql": " FOR UPDATE", "postgresql": " FOR UPDATE"}
_INSERT_IGNORE = {
    "sqlite": ("INSERT OR IGNORE INTO", ""),
    "mysql": ("INSERT IGNORE INTO", ""),
    "postgresql": ("INSERT INTO", " ON CONFLICT (digest) DO NOTHING"),
}


class _SQL:
    """The statements of one vendor, with the tables' quoted names."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        from ...models import Lease, ParkedCall, Slot

        vendor = connection.vendor
        q = connection.ops.quote_name
        lease, slot, parked = (q(m._meta.db_table) for m in (Lease, Slot, ParkedCall))
        now, binary = SERVER_CLOCK[vendor], BINARY[vendor]
        self.vendor = vendor
        self.begin = _BEGIN[vendor]
        self.isolation = _ISOLATION.get(vendor)
        insert, conflict = _INSERT_IGNORE[vendor]
        # params: digest, namespace, name. The counter is seeded from the clock.
        self.counter_row = (
            f"{insert} {lease} (digest, namespace, name, fence, holder)"
            f" VALUES (%s, %s, %s, {now}, ''){conflict}"
        )
        # params: digest; returns: the counter (the row locked until commit).
        self.lock_counter = f"SELECT fence FROM {lease} WHERE digest = %s{_LOCK_ROW[vendor]}"
        self.set_counter = f"UPDATE {lease} SET fence = %s WHERE digest = %s"
        self.drop_ended = f"DELETE FROM {slot} WHERE digest = %s AND expires_at_us <= {now}"
        self.rows = f"SELECT owner, slot_limit, weight, token FROM {slot} WHERE digest = %s"
        # The rows that drop_ended keeps (SQLite inside the caller's atomic(): read first).
        self.live_rows = f"{self.rows} AND expires_at_us > {now}"
        self.forget = f"DELETE FROM {slot} WHERE digest = %s AND owner = %s"
        # params: digest, namespace, name, owner, limit, weight, token, ttl (us), holder
        self.insert = (
            f"INSERT INTO {slot} (digest, namespace, name, owner, slot_limit, weight, token,"
            f" acquired_at_us, expires_at_us, holder)"
            f" VALUES (%s, %s, %s, %s, %s, %s, %s, {now}, {now} + %s, %s)"
        )
        live = f"digest = %s AND owner = %s AND token IS NOT NULL AND expires_at_us > {now}"
        self.leave = f"DELETE FROM {slot} WHERE digest = %s AND owner = %s AND token IS NULL"
        self.release = f"DELETE FROM {slot} WHERE {live}"
        self.extend = f"UPDATE {slot} SET expires_at_us = {now} + %s WHERE {live}"
        # As the mutex's extend_owned (a slot taken inside a transaction).
        self.extend_owned = (
            f"UPDATE {slot} SET expires_at_us = {now} + %s"
            " WHERE digest = %s AND owner = %s AND token IS NOT NULL"
        )
        self.check = f"SELECT 1 FROM {slot} WHERE {live}"
        held = f"digest = %s AND token IS NOT NULL AND expires_at_us > {now}"
        self.break_all = f"DELETE FROM {slot} WHERE {held}"
        self.break_token = f"DELETE FROM {slot} WHERE {held} AND token = %s"
        in_prefix = (
            f"{binary.format('namespace')} = {binary.format('%s')}"
            f" AND {binary.format('substr(name, 1, %s)')} = {binary.format('%s')}"
        )
        # params: namespace, len(prefix), prefix
        self.list = (
            f"SELECT name, slot_limit, weight, token, holder, acquired_at_us, expires_at_us,"
            f" {now} FROM {slot} WHERE expires_at_us > {now} AND {in_prefix}"
        )
        self.unpark_one = f"DELETE FROM {parked} WHERE digest = %s AND call_id = %s"
        # params: digest, namespace, name, call id, place, payload
        self.park = (
            f"INSERT INTO {parked} (digest, namespace, name, call_id, place, payload)"
            " VALUES (%s, %s, %s, %s, %s, %s)"
        )
        self.first_parked = (
            f"SELECT id, name, call_id, place, payload FROM {parked} WHERE digest = %s"
            f" ORDER BY place, call_id LIMIT %s{_LOCK_ROW[vendor]}"
        )
        self.unpark_ids = f"DELETE FROM {parked} WHERE id IN ({{}})"
        self.list_parked = f"SELECT name, call_id, place, payload FROM {parked} WHERE {in_prefix}"


class DatabaseSlots(SemaphoreBackend, ParkingBackend):
    """The ``*_slot`` and parking primitives of :class:`~.backend.DatabaseBackend`."""

    supports_fair_semaphores = False

    if TYPE_CHECKING:
        database: str

        _bound: dict[str, tuple[BaseDatabaseWrapper, int]]

        def _key(self, name: str) -> str: ...
        def _connection(self, owner: str | None = None) -> BaseDatabaseWrapper: ...
        def _bind(self, owner: str, connection: BaseDatabaseWrapper) -> None: ...
        def _unbind(self, owner: str) -> None: ...
        def _release_elsewhere(self, owner: str, release: Callable[[], Any]) -> bool: ...
        def _renew_elsewhere(self, name: str, owner: str, renew: Callable[[], bool]) -> bool: ...
        def _in_transaction(self, name: str, what: str) -> LockInTransaction: ...
        def _run(
            self,
            name: str,
            fn: Callable[[BaseDatabaseWrapper, Any, Any], T],
            owner: str | None = None,
            connection: BaseDatabaseWrapper | None = None,
        ) -> T: ...
        def _retry_busy(
            self,
            name: str,
            fn: Callable[[BaseDatabaseWrapper, Any, Any], T],
            owner: str | None = None,
            connection: BaseDatabaseWrapper | None = None,
        ) -> T: ...

    def _slot_sql(self, connection: BaseDatabaseWrapper) -> _SQL:
        cache: dict[str, _SQL] = self.__dict__.setdefault("_slot_sql_cache", {})
        sql = cache.get(connection.vendor)
        if sql is None:
            sql = cache[connection.vendor] = _SQL(connection)
        return sql

    def _counter_key(self, name: str) -> str:
        return hashlib.sha256(f"slots\0{self.key_prefix}\0{name}".encode()).hexdigest()

    def _slot_call(
        self,
        name: str,
        fn: Callable[[_SQL, Any], T],
        transaction: bool = False,
        refuse_busy: bool = False,
        owner: str | None = None,
    ) -> T:
        """``fn(sql, cursor)`` on the slot connection, in a transaction of its own if asked.

        The connection is the mutex's (``_connection(owner)``): on SQLite
        inside ``atomic()`` the caller's, joining its transaction (no
        transaction of its own then), or the one ``owner``'s lease is bound to.

        ``refuse_busy``: on PostgreSQL and MySQL, a statement that waited for a
        row lock past ``sql.LOCK_WAIT`` makes this return None (an acquisition:
        refused, and tried again by its loop until its timeout), not retried.
        """
        connection = self._connection(owner)
        joined = connection.vendor == "sqlite" and connection.in_atomic_block

        def run(conn: BaseDatabaseWrapper, statements: Any, cursor: Any) -> T:
            sql = self._slot_sql(conn)
            if not transaction or joined:
                return fn(sql, cursor)
            # A holder paused inside this transaction would keep the counter
            # row locked for as long as it is paused: the server ends it once
            # it has been idle IDLE_IN_TRANSACTION. PostgreSQL: for this
            # transaction only. MariaDB: for the session, restored after.
            mariadb = sql.vendor == "mysql" and getattr(conn, "mysql_is_mariadb", False)
            if mariadb:
                cursor.execute(
                    "SET @dlock_idle = @@SESSION.idle_transaction_timeout,"
                    f" SESSION idle_transaction_timeout = {max(1, round(IDLE_IN_TRANSACTION))}"
                )
            try:
                if sql.isolation:
                    cursor.execute(sql.isolation)
                cursor.execute(sql.begin)
                try:
                    if sql.vendor == "postgresql":
                        idle = f"{ms(IDLE_IN_TRANSACTION)}ms"
                        cursor.execute(f"SET LOCAL idle_in_transaction_session_timeout = '{idle}'")
                    result = fn(sql, cursor)
                    cursor.execute("COMMIT")
                except BaseException:
                    # A COMMIT that failed leaves the transaction open: the next
                    # BEGIN would fail with "cannot start a transaction within a
                    # transaction".
                    with contextlib.suppress(DatabaseError):
                        cursor.execute("ROLLBACK")
                    raise
            finally:
                if mariadb:
                    with contextlib.suppress(DatabaseError):
                        cursor.execute("SET SESSION idle_transaction_timeout = @dlock_idle")
            return result

        if joined:
            # SQLite inside the caller's atomic(): another writer has the
            # database, and it may be waiting for this transaction to end. No
            # wait here can outlast it: refuse at once, as the mutex does.
            try:
                return self._run(name, run, connection=connection)
            except Busy as e:
                raise self._in_transaction(
                    name,
                    "cannot be written: another writer has the database, and it may be "
                    "waiting for this transaction to end (waiting for it would deadlock)",
                ) from e.__cause__
        if connection.vendor != "sqlite" and refuse_busy:
            try:
                return self._run(name, run, connection=connection)
            except Busy:
                return cast(T, None)  # refuse_busy: only for a T that may be None
        return self._retry_busy(name, run, connection=connection)

    def do_acquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> int | None:
        digest, counter = self._key(name), self._counter_key(name)
        connection = connections[self.database]
        joined = connection.vendor == "sqlite" and connection.in_atomic_block

        def fits(rows: list[tuple[Any, int, int, Any]]) -> bool:
            other = next((lim for _, lim, _, _ in rows if lim != limit), None)
            if other is not None:
                raise self.limit_mismatch(name, limit, other)
            used = sum(w for _, _, w, t in rows if t is not None)
            writer_waits = weight < limit and any(t is None and w == limit for _, _, w, t in rows)
            return used + weight <= limit and not writer_waits

        def others(cursor: Any) -> list[tuple[Any, int, int, Any]]:
            return [(o, int(lim), int(w), t) for o, lim, w, t in cursor.fetchall() if o != owner]

        def grant(sql: _SQL, cursor: Any, fence: int) -> int:
            # SQLite: a rolled-back grant's token is not issued again (see above).
            token = max(fence + 1, wall_micros()) if sql.vendor == "sqlite" else fence + 1
            cursor.execute(sql.set_counter, [token, counter])
            cursor.execute(
                sql.insert,
                [digest, self.key_prefix, name, owner, limit, weight, token, micros(ttl), holder],
            )
            return token

        def run(sql: _SQL, cursor: Any) -> int | None:
            # Lock the counter row; create it first only if missing (an INSERT
            # that finds the row takes a shared lock on MySQL, and two such
            # transactions deadlock when both then ask for the row exclusively).
            cursor.execute(sql.lock_counter, [counter])
            row = cursor.fetchone()
            if row is None:
                cursor.execute(sql.counter_row, [counter, self.key_prefix, name])
                cursor.execute(sql.lock_counter, [counter])
                row = cursor.fetchone()
            fence = int(row[0])
            cursor.execute(sql.drop_ended, [digest])
            cursor.execute(sql.rows, [digest])
            free = fits(others(cursor))
            cursor.execute(sql.forget, [digest, owner])
            if not free:
                values = [digest, self.key_prefix, name, owner, limit, weight]
                cursor.execute(sql.insert, [*values, None, micros(ttl), ""])
                return None
            return grant(sql, cursor, fence)

        def in_callers_transaction(sql: _SQL, cursor: Any) -> int:
            # Read first, write only once granted: a refused attempt that
            # wrote would hold SQLite's write lock for the caller's whole
            # transaction, and the holders could not release meanwhile.
            cursor.execute(sql.live_rows, [digest])
            if not fits(others(cursor)):
                raise self._in_transaction(
                    name,
                    "has no free slot, and a transaction on SQLite cannot wait for one: "
                    "a holder's release could wait for this transaction",
                )
            cursor.execute(sql.counter_row, [counter, self.key_prefix, name])
            cursor.execute(sql.lock_counter, [counter])
            fence = int(cursor.fetchone()[0])
            cursor.execute(sql.drop_ended, [digest])
            cursor.execute(sql.forget, [digest, owner])
            return grant(sql, cursor, fence)

        if joined:
            token = self._slot_call(name, in_callers_transaction)
            # Bound until the transaction ends, as the mutex's lease is.
            self._bind(owner, connection)
            return token
        return self._slot_call(name, run, transaction=True, refuse_busy=True)

    def _slot_rowcount(
        self, name: str, statement: str, params: list[Any], owner: str | None = None
    ) -> int:
        def run(sql: _SQL, cursor: Any) -> int:
            cursor.execute(getattr(sql, statement), params)
            return int(cursor.rowcount)

        return self._slot_call(name, run, owner=owner)

    def do_leave_slot(self, name: str, owner: str) -> None:
        self._slot_rowcount(name, "leave", [self._key(name), owner], owner)

    def do_release_slot(self, name: str, owner: str) -> bool:
        key = self._key(name)
        if self._release_elsewhere(
            owner, lambda: self._slot_rowcount(name, "release", [key, owner])
        ):
            return True
        connection = self._connection(owner)
        # Joined the caller's transaction though taken outside it (not bound).
        unbound_join = (
            owner not in self._bound
            and connection.vendor == "sqlite"
            and connection.in_atomic_block
        )
        until = time.monotonic() + RELEASE_LATER_FOR
        try:
            released = self._slot_rowcount(name, "release", [key, owner], owner) == 1
        except LockInTransaction:
            # SQLite, inside the caller's atomic() that has not written: another
            # writer has the database. Raising here would roll back the
            # caller's work; the release is finished off this thread as soon
            # as that writer and this transaction let it (or the lease runs out).
            self._release_later(name, owner, until)
            return True
        finally:
            self._unbind(owner)
        if released and unbound_join:
            # A slot taken before the caller's transaction, released inside it:
            # a rollback would undo the release. Released again (a no-op after
            # a commit) from the renewal thread once the transaction ends.
            at_transaction_end(
                connection, functools.partial(self._release_later, name, owner, until)
            )
        return released

    def _release_later(self, name: str, owner: str, until: float) -> None:
        from ...watchdog import get_watchdog

        watchdog = get_watchdog()

        def attempt() -> None:
            try:
                self._slot_rowcount(name, "release", [self._key(name), owner])
            except Exception:
                if time.monotonic() < until:
                    self._release_later(name, owner, until)
                else:
                    logger.warning("Gave up releasing the slot of %r on %r", name, self.alias)

        watchdog.call_at(
            time.monotonic() + 0.2, lambda: watchdog.renewer(self.alias).submit(attempt)
        )

    def do_extend_slot(self, name: str, owner: str, ttl: float) -> bool:
        params = [micros(ttl), self._key(name), owner]
        if self._renew_elsewhere(
            name, owner, lambda: self._slot_rowcount(name, "extend_owned", params) == 1
        ):
            return True
        return self._slot_rowcount(name, "extend", params, owner) == 1

    def do_check_slot(self, name: str, owner: str) -> bool:
        def run(sql: _SQL, cursor: Any) -> bool:
            cursor.execute(sql.check, [self._key(name), owner])
            return cursor.fetchone() is not None

        return self._slot_call(name, run, owner=owner)

    def do_break_slot(self, name: str, token: int | None) -> int:
        if token is None:
            return self._slot_rowcount(name, "break_all", [self._key(name)])
        return self._slot_rowcount(name, "break_token", [self._key(name), token])

    def do_list_slots(self, prefix: str) -> list[SlotEntry]:
        def run(sql: _SQL, cursor: Any) -> list[Any]:
            cursor.execute(sql.list, [self.key_prefix, len(prefix), prefix])
            return list(cursor.fetchall())

        entries = []
        for name, limit, weight, token, holder, acquired, expires, now in self._slot_call(
            prefix, run
        ):
            info = None
            if token is not None:
                info = LockInfo(
                    backend=self.alias,
                    name=name,
                    token=int(token),
                    holder=load_holder(holder),
                    acquired_at=micros_to_datetime(int(acquired)),
                    expires_at=micros_to_datetime(int(expires)),
                    expires_in=(int(expires) - int(now)) / 1_000_000,
                )
            entries.append(SlotEntry(name, int(limit), int(weight), info))
        return entries

    # --- parked Celery calls ----------------------------------------------------------

    def do_park(self, name: str, key: str, order: int, payload: str) -> None:
        digest = self._key(name)

        def run(sql: _SQL, cursor: Any) -> None:
            cursor.execute(sql.unpark_one, [digest, key])
            cursor.execute(sql.park, [digest, self.key_prefix, name, key, order, payload])

        self._slot_call(name, run, transaction=True)

    def do_unpark(self, name: str, count: int) -> list[ParkedTask]:
        digest = self._key(name)

        def run(sql: _SQL, cursor: Any) -> list[ParkedTask]:
            cursor.execute(sql.first_parked, [digest, count])
            rows = list(cursor.fetchall())
            if rows:
                ids = [row[0] for row in rows]
                cursor.execute(sql.unpark_ids.format(", ".join(["%s"] * len(ids))), ids)
            return [ParkedTask(n, k, int(o), p) for _, n, k, o, p in rows]

        return self._slot_call(name, run, transaction=True)

    def do_unpark_key(self, name: str, key: str) -> bool:
        return self._slot_rowcount(name, "unpark_one", [self._key(name), key]) == 1

    def do_list_parked(self, prefix: str) -> list[ParkedTask]:
        def run(sql: _SQL, cursor: Any) -> list[Any]:
            cursor.execute(sql.list_parked, [self.key_prefix, len(prefix), prefix])
            return list(cursor.fetchall())

        return [ParkedTask(n, k, int(o), p) for n, k, o, p in self._slot_call(prefix, run)]
