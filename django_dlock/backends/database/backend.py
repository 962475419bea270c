"""DatabaseBackend: mutexes in the lease table, on the thread's or a private connection.

The package's docstring (``__init__.py``) says which connection runs the
statements and why, and how SQLite inside ``transaction.atomic()`` is kept safe.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from django.apps import apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import DatabaseError, IntegrityError, InterfaceError, OperationalError

from ..._validation import load_holder, micros_to_datetime
from ...commit_hooks import at_transaction_end
from ...exceptions import BackendUnavailable, LockConfigurationError, LockInTransaction
from ..base import BaseLockBackend, LockInfo
from ..types import Busy, extend_each
from .bound import BoundLeases
from .slots import DatabaseSlots
from .sql import SERVER_CLOCK, add_clock, bounded, lock_not_available, micros
from .statements import Statements, extend_rows, vendor_statements

T = TypeVar("T")

logger = logging.getLogger("django_dlock")

SUPPORTED_VENDORS = ("sqlite", "postgresql", "mysql")

#: Retries of release, extend, check and break when the database is busy.
BUSY_RETRIES = 6

# MySQL error codes for a lost race between transactions: deadlock, lock wait timeout.
_MYSQL_RETRYABLE = {1213, 1205}

# MySQL/MariaDB: a string the column's character set cannot hold (a name with a
# 4-byte character in a utf8mb3 table).
_MYSQL_BAD_STRING = 1366
# What no retry fixes (see BackendUnavailable.transient). MySQL/MariaDB codes:
# access denied to a database / for a user, unknown database, command or column
# denied, no such table, missing privilege, socket auth refused; and a bad string.
_MYSQL_REFUSED = {1044, 1045, 1049, 1142, 1143, 1146, 1227, 1698, _MYSQL_BAD_STRING}
# PostgreSQL SQLSTATE classes: 28 invalid authorization, 3D no such database,
# 42 access rule violation (permission denied, no such table).
_PG_REFUSED = ("28", "3D", "42")
# psycopg reports a refused connection with no SQLSTATE, only the server's text.
_PG_REFUSED_TEXT = (
    "password authentication failed",
    "no pg_hba.conf entry",
    "does not exist",
    "permission denied",
    # SQLite: a NAME whose directory is missing or not writable.
    "unable to open database file",
)


def _transient(error: Exception) -> bool:
    """Whether trying the statement again later may succeed (a server restarting may)."""
    if not isinstance(error, (OperationalError, InterfaceError)):
        return False  # ProgrammingError, DataError, ...: the same statement fails again
    cause = error.__cause__ or error
    if error.args and error.args[0] in _MYSQL_REFUSED:
        return False
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if isinstance(sqlstate, str) and sqlstate.startswith(_PG_REFUSED):
        return False
    text = str(error)
    return not any(refused in text for refused in _PG_REFUSED_TEXT)


class DatabaseBackend(BoundLeases, DatabaseSlots, BaseLockBackend):
    """Leases in the ``django_dlock_lease`` table of a Django database.

    ``OPTIONS``: ``database``, the alias in ``DATABASES`` (default "default").
    """

    allowed_options = frozenset({"database"})
    uses_django_connections = True
    # 3 parameters a lease: under SQLite's old limit of 999 a statement.
    renew_batch = 300

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        if self.location is not None:
            raise LockConfigurationError(
                f"Lock backend {alias!r}: the database backend does not use LOCATION; name "
                "the database with OPTIONS={'database': '<alias in DATABASES>'}.",
                alias=alias,
            )
        if not apps.is_installed("django_dlock"):
            # Its table's model cannot be imported; say so before any lock
            # fails with Django's "doesn't declare an explicit app_label".
            raise LockConfigurationError(
                f"Lock backend {alias!r} uses the database backend, which needs "
                "'django_dlock' in INSTALLED_APPS for its table: add it there and run "
                "`manage.py migrate`.",
                alias=alias,
                check_id="django_dlock.E007",
            )
        self.database = self.options.get("database", DEFAULT_DB_ALIAS)
        if not isinstance(self.database, str):
            raise LockConfigurationError(
                f"Lock backend {alias!r}: OPTIONS['database'] must be a DATABASES alias.",
                alias=alias,
            )
        self._local = threading.local()
        self._statements_cache: dict[str, Statements] = {}
        self._init_bound()

    def check(self) -> list[checks.CheckMessage]:
        from django.conf import settings

        if self.database not in settings.DATABASES:
            problem = "is not in DATABASES"
        else:
            engine = settings.DATABASES[self.database].get("ENGINE")
            try:
                vendor = connections[self.database].vendor
            except Exception as e:  # an ENGINE (or its driver) that cannot be imported
                vendor, problem = None, f"has an ENGINE ({engine!r}) that cannot be loaded: {e}"
            else:
                try:  # what the first connection would refuse: no NAME, say
                    if vendor in SUPPORTED_VENDORS:
                        connections[self.database].get_connection_params()
                except ImproperlyConfigured as e:
                    vendor, problem = None, f"cannot be connected to: {e}"
            if vendor is not None and vendor not in SUPPORTED_VENDORS:
                problem = (
                    f"has the ENGINE {engine!r}; the database backend supports "
                    f"{', '.join(SUPPORTED_VENDORS)}"
                )
            elif vendor is not None:
                return []
        message = f"Lock backend {self.alias!r}: database {self.database!r} {problem}."
        return [checks.Error(message, id="django_dlock.E008")]

    def close(self) -> None:
        private = getattr(self._local, "connection", None)
        if private is not None:
            self._close_private(private)

    # --- plumbing -------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return hashlib.sha256(f"{self.key_prefix}\0{name}".encode()).hexdigest()

    def _connection(self, owner: str | None = None) -> BaseDatabaseWrapper:
        if owner is not None:
            bound = self._bound_here(owner)
            if bound is not None:
                return bound
        connection = connections[self.database]
        if connection.vendor == "sqlite" or not connection.in_atomic_block:
            return connection
        return self._private()

    def _private(self) -> BaseDatabaseWrapper:
        """This thread's private connection, for use inside ``atomic()`` on ``self.database``.

        It lives as long as the transaction that needed it: it is closed when
        that transaction commits or rolls back (an ``ATOMIC_REQUESTS``
        request's, a ``TestCase`` test's), so it never outlives the
        connections Django closes, and needs no ``CONN_MAX_AGE`` of its own.
        """
        private = getattr(self._local, "connection", None)
        if private is None:
            private = self._local.connection = connections.create_connection(self.database)
            at_transaction_end(
                connections[self.database], functools.partial(self._close_private, private)
            )
        return private

    def _close_private(self, private: BaseDatabaseWrapper) -> None:
        if getattr(self._local, "connection", None) is private:
            self._local.connection = None
        if getattr(private, "_thread_ident", None) != threading.get_ident():  # freed late
            private.inc_thread_sharing()
        with contextlib.suppress(DatabaseError):  # a broken connection is closed all the same
            private.close()

    def _sql(self, connection: BaseDatabaseWrapper) -> Statements:
        vendor = connection.vendor
        statements = self._statements_cache.get(vendor)
        if statements is None:
            if vendor not in SUPPORTED_VENDORS:
                raise ImproperlyConfigured(
                    f"Lock backend {self.alias!r}: the database backend does not support "
                    f"{vendor} (supported: {', '.join(SUPPORTED_VENDORS)})."
                )
            from ...models import Lease

            table = connection.ops.quote_name(Lease._meta.db_table)
            statements = self._statements_cache[vendor] = vendor_statements(vendor, table)
        return statements

    def _run(
        self,
        name: str,
        fn: Callable[[BaseDatabaseWrapper, Statements, Any], T],
        owner: str | None = None,
        connection: BaseDatabaseWrapper | None = None,
    ) -> T:
        connection = connection or self._connection(owner)
        statements = self._sql(connection)
        try:
            if connection.vendor == "sqlite":
                add_clock(connection)  # opens the file: inside, so its errors are ours
            with connection.cursor() as cursor:
                return fn(connection, statements, bounded(connection, cursor))
        except (OperationalError, InterfaceError) as e:
            if connection.vendor == "sqlite" and "locked" in str(e):
                raise Busy from e
            if connection.vendor == "postgresql" and lock_not_available(e):
                raise Busy from e  # a row lock held past LOCK_WAIT (sql.bounded)
            if connection.vendor == "mysql" and e.args and e.args[0] in _MYSQL_RETRYABLE:
                raise Busy from e
            self._discard(connection)
            raise self._unavailable(connection, name, e) from e
        except DatabaseError as e:
            raise self._unavailable(connection, name, e) from e

    def _discard(self, connection: BaseDatabaseWrapper) -> None:
        # Outside a transaction a broken connection is closed so that the next
        # call reconnects; inside one, the caller's atomic block owns it.
        if not connection.in_atomic_block:
            connection.close()

    def _unavailable(
        self, connection: BaseDatabaseWrapper, name: str, error: Exception
    ) -> BackendUnavailable:
        from ...models import Lease

        what = f" for lock {name!r}" if name else ""
        message = f"Database {self.database!r} failed{what}: {error}"
        transient = _transient(error)
        if error.args and error.args[0] == _MYSQL_BAD_STRING:
            message += (
                ". Its tables' character set cannot store every name: convert them to"
                " utf8mb4 (docs/backends/database.md)."
            )
        try:
            with connection.cursor() as cursor:
                tables = connection.introspection.table_names(cursor)
            if Lease._meta.db_table not in tables:
                message = (
                    f"Table {Lease._meta.db_table} is missing from database {self.database!r}:"
                    " run `manage.py migrate django_dlock`."
                )
                transient = False
        except DatabaseError:
            pass
        return BackendUnavailable(message, name=name, backend=self.alias, transient=transient)

    def _retry_busy(
        self,
        name: str,
        fn: Callable[[BaseDatabaseWrapper, Statements, Any], T],
        owner: str | None = None,
        connection: BaseDatabaseWrapper | None = None,
    ) -> T:
        # Release, extend and break must not be dropped because another writer
        # held SQLite's lock past its busy timeout, or MySQL picked us as a
        # deadlock victim.
        attempt = 0
        while True:
            try:
                return self._run(name, fn, owner, connection)
            except Busy as e:
                if attempt == BUSY_RETRIES:
                    raise BackendUnavailable(
                        f"Database {self.database!r} stayed busy for lock {name!r}.",
                        name=name,
                        backend=self.alias,
                    ) from e.__cause__
                # SQLite's shared-cache "locked" does not wait for the busy
                # timeout; give the other writer a moment (1 ms, doubling).
                time.sleep(0.001 * 2**attempt)
                attempt += 1

    # --- primitives -----------------------------------------------------------------

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | None:
        digest, ttl_us = self._key(name), micros(ttl)

        def free_then_take(sql: Statements, cursor: Any) -> int | None:
            cursor.execute(sql.get, [digest])
            if cursor.fetchone() is not None:
                return None
            cursor.execute(sql.acquire, [digest, self.key_prefix, name, owner, ttl_us, holder])
            row = cursor.fetchone()
            return None if row is None else int(row[0])

        def sqlite(connection: BaseDatabaseWrapper, sql: Statements, cursor: Any) -> int | None:
            if connection.in_atomic_block:  # joined: see the module docstring
                token = free_then_take(sql, cursor)
                if token is None:
                    raise self._in_transaction(
                        name,
                        "is held by someone else, and a transaction on SQLite cannot wait "
                        "for it: the holder's release could wait for this transaction",
                    )
                self._bind(owner, connection)
                return token
            # The acquire statement is a write: t0 the holder's transaction
            # reads (SQLite's shared lock), t1 a waiter's statement takes the
            # write lock, t2 the holder's first write cannot take it and fails
            # with "database is locked" (SQLite does not wait there). So a
            # waiter reads first, and writes only if the name is free, in one
            # transaction: no other acquisition can commit between its read
            # and its write.
            if not connection.get_autocommit():  # a transaction managed by hand
                return free_then_take(sql, cursor)
            cursor.execute("BEGIN")
            try:
                token = free_then_take(sql, cursor)
                cursor.execute("COMMIT")
            except BaseException:
                if connection.connection.in_transaction:
                    cursor.execute("ROLLBACK")
                raise
            return token

        def run(connection: BaseDatabaseWrapper, sql: Statements, cursor: Any) -> int | None:
            if connection.vendor == "sqlite":
                return sqlite(connection, sql, cursor)
            if sql.acquire_insert is None:
                cursor.execute(sql.acquire, [digest, self.key_prefix, name, owner, ttl_us, holder])
                row = cursor.fetchone()
                return None if row is None else int(row[0])
            cursor.execute(sql.acquire, [owner, ttl_us, holder, digest])
            if cursor.rowcount == 1:
                return int(cursor.lastrowid)
            try:
                cursor.execute(
                    sql.acquire_insert, [digest, self.key_prefix, name, owner, ttl_us, holder]
                )
            except IntegrityError:
                return None
            return int(cursor.lastrowid)

        try:
            return self._run(name, run)
        except Busy as e:
            connection = self._connection()
            if connection.vendor == "sqlite" and connection.in_atomic_block:
                raise self._in_transaction(
                    name,
                    "cannot be written: another writer has the database, and it may be "
                    "waiting for this transaction to end (waiting for it would deadlock)",
                ) from e.__cause__
            return None

    def _in_transaction(self, name: str, what: str) -> LockInTransaction:
        return LockInTransaction(
            f"Lock {name!r} on backend {self.alias!r} {what}. On SQLite a lock taken inside "
            "transaction.atomic() cannot wait. Take it before entering the transaction: "
            "`with lock(...): with transaction.atomic(): ...`.",
            name=name,
            backend=self.alias,
        )

    def _rowcount(
        self, name: str, statement: str, params: list[Any], owner: str | None = None
    ) -> bool:
        def run(connection: BaseDatabaseWrapper, sql: Statements, cursor: Any) -> bool:
            cursor.execute(getattr(sql, statement), params)
            return bool(cursor.rowcount == 1)

        return self._retry_busy(name, run, owner)

    def do_release(self, name: str, owner: str) -> bool:
        key = self._key(name)
        if self._release_elsewhere(owner, lambda: self._rowcount(name, "release", [key, owner])):
            return True
        try:
            return self._rowcount(name, "release", [key, owner], owner)
        finally:
            self._unbind(owner)

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        params = [micros(ttl), self._key(name), owner]
        if self._renew_elsewhere(
            name, owner, lambda: self._rowcount(name, "extend_owned", params)
        ):
            return True
        return self._rowcount(name, "extend", params, owner)

    def do_extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]:
        results: list[bool | Exception] = [False] * len(leases)
        by_ttl: dict[int, list[int]] = {}
        for i, (_name, owner, ttl) in enumerate(leases):
            if owner in self._bound:  # taken inside SQLite's atomic(): its own thread only
                results[i] = extend_each(self.do_extend, [leases[i]])[0]
            else:
                by_ttl.setdefault(micros(ttl), []).append(i)
        for ttl_us, indexes in by_ttl.items():
            pairs = [(self._key(leases[i][0]), leases[i][1]) for i in indexes]
            try:
                extended = self._retry_busy(
                    leases[indexes[0]][0], functools.partial(extend_rows, ttl_us, pairs)
                )
            except BackendUnavailable as e:
                for i in indexes:
                    results[i] = e
                continue
            for i, pair in zip(indexes, pairs, strict=True):
                results[i] = pair in extended
        return results

    def do_adopt(self, name: str, owner: str, new_owner: str, ttl: float, state: Any) -> bool:
        return self._rowcount(
            name, "adopt", [new_owner, micros(ttl), self._key(name), owner], owner
        )

    def do_break(self, name: str, token: int | None) -> bool:
        if token is None:
            return self._rowcount(name, "break_", [self._key(name)])
        return self._rowcount(name, "break_token", [self._key(name), token])

    #: ``do_server_time`` reads the clock leases end on (``clocks.py``).
    tells_server_time = True

    def do_server_time(self) -> float | None:
        """The database's clock, in seconds since the epoch (SQLite's: this machine's)."""

        def run(connection: BaseDatabaseWrapper, sql: Statements, cursor: Any) -> float:
            # Parameters, though none: Django's SQLite cursor then turns %% into %.
            cursor.execute(f"SELECT {SERVER_CLOCK[connection.vendor]}", [])
            return int(cursor.fetchone()[0]) / 1_000_000

        return self._retry_busy("", run)

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        def run(connection: BaseDatabaseWrapper, sql: Statements, cursor: Any) -> str:
            cursor.execute(sql.version)
            return str(cursor.fetchone()[0])

        return self._retry_busy("", run), ()

    def do_check(self, name: str, owner: str) -> bool:
        def run(connection: BaseDatabaseWrapper, sql: Statements, cursor: Any) -> bool:
            cursor.execute(sql.check, [self._key(name), owner])
            return cursor.fetchone() is not None

        return self._retry_busy(name, run, owner)

    def do_list(self, prefix: str) -> list[LockInfo]:
        def run(connection: BaseDatabaseWrapper, sql: Statements, cursor: Any) -> list[Any]:
            cursor.execute(sql.list, [self.key_prefix, len(prefix), prefix])
            return list(cursor.fetchall())

        return [self._info(row) for row in self._retry_busy(prefix, run)]

    def do_get(self, name: str) -> LockInfo | None:
        def run(connection: BaseDatabaseWrapper, sql: Statements, cursor: Any) -> Any:
            cursor.execute(sql.get, [self._key(name)])
            return cursor.fetchone()

        row = self._retry_busy(name, run)
        return None if row is None else self._info(row)

    def _info(self, row: tuple[Any, ...]) -> LockInfo:
        """A row of the list or get statement as a LockInfo."""
        name, fence, holder, acquired_us, expires_us, now_us = row
        return LockInfo(
            backend=self.alias,
            name=name,
            token=int(fence),
            holder=load_holder(holder),
            acquired_at=micros_to_datetime(int(acquired_us)),
            expires_at=micros_to_datetime(int(expires_us)),
            expires_in=(int(expires_us) - int(now_us)) / 1_000_000,
        )
