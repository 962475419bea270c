"""SQL that the database backend's mutexes and semaphores share (its clock, busy errors)."""

from __future__ import annotations

import time

from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["BINARY", "SERVER_CLOCK", "Busy", "add_clock", "micros", "wall_us"]

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


def wall_us() -> int:
    return time.time_ns() // 1000


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
        raw.create_function("dlock_now_us", 0, wall_us)
        connection._dlock_clock = raw  # type: ignore[attr-defined]


class Busy(Exception):
    """The database refused the statement for contention; the attempt may be repeated."""
