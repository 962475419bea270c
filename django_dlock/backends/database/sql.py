"""SQL that the database backend's mutexes and semaphores share (its clock, bounded waits)."""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from ...clocks import ms, wall_micros

__all__ = ["BINARY", "SERVER_CLOCK", "add_clock", "micros"]

# The server's clock as integer microseconds since the epoch. Each expression
# has one value for the whole statement, so a statement compares and stores
# the same instant everywhere it appears.
SERVER_CLOCK = {
    # statement_timestamp(): start of the statement, stable within it.
    "postgresql": "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000000)::bigint",
    # UTC_TIMESTAMP(6): start of the statement, stable within it, and in UTC
    # whatever the session's time_zone. (UNIX_TIMESTAMP(NOW(6)) went through
    # the session time zone: in a zone with daylight saving, local times in
    # the repeated hour map to the wrong instant, and the clock jumped an hour.)
    "mysql": "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))",
    # 'now' is stable within one sqlite3_step(); '%f' is "SS.SSS" (milliseconds).
    # '%%' because Django's SQLite cursor turns '%s' into a placeholder.
    "sqlite": (
        "(CAST(strftime('%%s', 'now') AS INTEGER) * 1000000"
        " + CAST(substr(strftime('%%f', 'now'), 4, 3) AS INTEGER) * 1000)"
    ),
}

# MySQL's default collations ignore case; lock names must not.
BINARY = {
    "mysql": "CAST({} AS BINARY)",
    "postgresql": "{}",
    "sqlite": "{}",
}


def micros(seconds: float) -> int:
    return max(1, round(seconds * 1_000_000))


def add_clock(connection: BaseDatabaseWrapper) -> None:
    """Give an SQLite connection ``dlock_now_us()``: the wall clock in microseconds.

    SQLite's own ``'now'`` steps in milliseconds; tokens need finer steps
    (several acquisitions fit in one). It is the same clock, the machine's,
    which every process using the file shares.
    """
    if connection.connection is None:
        connection.ensure_connection()
    raw = connection.connection
    if getattr(connection, "_dlock_clock", None) is not raw:
        raw.create_function("dlock_now_us", 0, wall_micros)
        connection._dlock_clock = raw  # type: ignore[attr-defined]


#: How long one statement of the backend waits for a row lock that another
#: transaction holds, seconds (PostgreSQL ``lock_timeout``; MariaDB's
#: ``innodb_lock_wait_timeout`` counts whole seconds, so 1 there). A holder
#: paused (SIGSTOP) or stuck inside a transaction that locked a row must not
#: hold a waiter past its timeout, nor a renewal forever: the statement fails
#: as ``Busy`` instead (an attempt then counts as refused and is tried again,
#: a release or renewal is retried, BUSY_RETRIES times).
LOCK_WAIT = 0.5
#: How long the backend's own transactions (a semaphore's) may sit idle on
#: PostgreSQL before the server ends them, seconds: a holder paused between
#: their statements would otherwise keep the counter row locked for as long
#: as it is paused.
IDLE_IN_TRANSACTION = 2.0

_DML = ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH")


class BoundedCursor:
    """A cursor whose statements wait for row locks at most LOCK_WAIT (issue 28, item 4).

    PostgreSQL: ``SET LOCAL lock_timeout`` sent with the statement, in one
    round trip; a query of several statements is one transaction, so the
    setting ends with it. Only on a connection in autocommit outside
    ``atomic()`` (the backend's own transaction, if any, is then the only one
    the setting can last for) and with client-side binding (Django's
    default; ``server_side_binding`` sends one statement a query). MariaDB:
    ``SET STATEMENT innodb_lock_wait_timeout=1, lock_wait_timeout=1 FOR`` the
    statement (row locks, and table locks such as ``LOCK TABLES``). Other
    vendors, and MySQL (no per-statement form), run the statement as is.
    """

    def __init__(self, cursor: Any, prefix: str, several: bool) -> None:
        self._cursor = cursor
        self._prefix = prefix
        self._several = several

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._cursor, attr)

    def execute(self, sql: str, params: Any = None) -> Any:
        if not sql.lstrip()[:6].upper().startswith(_DML):
            return self._cursor.execute(sql, params)
        result = self._cursor.execute(self._prefix + sql, params)
        if self._several:
            self._cursor.nextset()  # past the SET's empty result, to the statement's
        return result


def bounded(connection: BaseDatabaseWrapper, cursor: Any) -> Any:
    """``cursor``, or a :class:`BoundedCursor` over it where the vendor allows."""
    vendor = connection.vendor
    if vendor == "postgresql":
        options = connection.settings_dict.get("OPTIONS") or {}
        if options.get("server_side_binding") or connection.in_atomic_block:
            return cursor
        if not connection.get_autocommit():
            return cursor
        return BoundedCursor(cursor, f"SET LOCAL lock_timeout = '{ms(LOCK_WAIT)}ms'; ", True)
    if vendor == "mysql" and getattr(connection, "mysql_is_mariadb", False):
        seconds = max(1, round(LOCK_WAIT))
        # lock_wait_timeout: a table or metadata lock (LOCK TABLES, ALTER
        # TABLE), which waits a day by default.
        return BoundedCursor(
            cursor,
            f"SET STATEMENT innodb_lock_wait_timeout={seconds}, lock_wait_timeout={seconds} FOR ",
            False,
        )
    return cursor


def lock_not_available(error: BaseException) -> bool:
    """PostgreSQL's ``lock_timeout`` ran out (SQLSTATE 55P03)."""
    cause = error.__cause__
    return getattr(cause, "sqlstate", None) == "55P03"
