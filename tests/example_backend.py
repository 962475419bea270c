"""The example backend of docs/development.md ("Write a backend"): locks in one SQLite file.

Every process on the machine that opens the same file sees the same locks.
It uses only the standard library's ``sqlite3``: each primitive is one
statement, or one ``BEGIN IMMEDIATE`` transaction (SQLite's write lock), so
that each is atomic on the "service". The service's clock is the machine's
wall clock, read inside the transaction.

It has the mutex part of the contract only (``BaseLockBackend``): it
declares neither semaphores (``SemaphoreBackend``) nor parked tasks
(``ParkingBackend``), so ``acquire(name, limit=N)`` on it raises
``LockConfigurationError`` before any I/O, and the semaphore tests skip it.

It is in the tests, not the package: it runs the whole conformance suite
(tests/test_conformance.py, tests/test_model.py) as the "example" alias, so
the walk-through stays true.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from datetime import datetime, timezone
from typing import Any

from django_dlock.backends.base import BackendUnavailable, BaseLockBackend, LockInfo, load_holder

SCHEMA = """
CREATE TABLE IF NOT EXISTS lease (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    token INTEGER NOT NULL,
    acquired REAL NOT NULL,
    expires REAL NOT NULL,
    holder TEXT NOT NULL
);
-- The fencing counter of each name, kept when its lease row is deleted.
CREATE TABLE IF NOT EXISTS fence (name TEXT PRIMARY KEY, token INTEGER NOT NULL);
"""


class SQLiteFileBackend(BaseLockBackend):
    """``LOCATION``: the path of the SQLite file (created if missing)."""

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        if not isinstance(self.location, str) or not self.location:
            raise self.config_error("LOCATION must be the path of a SQLite file.")
        self._local = threading.local()

    def _db(self) -> sqlite3.Connection:
        """This thread's connection (a forked child opens its own)."""
        db = getattr(self._local, "db", None)
        if db is None or self._local.pid != os.getpid():
            # Autocommit (isolation_level=None): transactions are explicit.
            db = sqlite3.connect(self.location, timeout=30, isolation_level=None)
            db.executescript(SCHEMA)
            self._local.db, self._local.pid = db, os.getpid()
        return db

    def _run(self, sql: str, *args: Any) -> sqlite3.Cursor:
        try:
            return self._db().execute(sql, args)
        except sqlite3.Error as e:
            raise BackendUnavailable(str(e), backend=self.alias) from e

    def _key(self, name: str) -> str:
        return self.key_prefix + name

    # --- the primitives -------------------------------------------------------------

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | None:
        key = self._key(name)
        self._run("BEGIN IMMEDIATE")  # the write lock: nobody else decides meanwhile
        try:
            now = time.time()
            live = self._run("SELECT 1 FROM lease WHERE name = ? AND expires > ?", key, now)
            token = None
            if live.fetchone() is None:
                # Tokens must grow even if the file is lost (a new one starts
                # over): at least the wall clock in microseconds, as Redis does.
                token = self._run(
                    "INSERT INTO fence (name, token) VALUES (?, ?) ON CONFLICT (name) "
                    "DO UPDATE SET token = max(token + 1, excluded.token) RETURNING token",
                    key,
                    time.time_ns() // 1000,
                ).fetchone()[0]
                self._run(
                    "INSERT OR REPLACE INTO lease VALUES (?, ?, ?, ?, ?, ?)",
                    key, owner, token, now, now + ttl, holder,
                )  # fmt: skip
            self._run("COMMIT")
        except BaseException:
            if self._db().in_transaction:
                self._db().execute("ROLLBACK")
            raise
        return None if token is None else int(token)

    def do_release(self, name: str, owner: str) -> bool:
        return self._changed(
            "DELETE FROM lease WHERE name = ? AND owner = ? AND expires > ?",
            self._key(name), owner, time.time(),
        )  # fmt: skip

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        now = time.time()
        return self._changed(
            "UPDATE lease SET expires = ? WHERE name = ? AND owner = ? AND expires > ?",
            now + ttl, self._key(name), owner, now,
        )  # fmt: skip

    def do_adopt(self, name: str, owner: str, new_owner: str, ttl: float, state: Any) -> bool:
        now = time.time()
        return self._changed(
            "UPDATE lease SET owner = ?, expires = ? WHERE name = ? AND owner = ? AND expires > ?",
            new_owner, now + ttl, self._key(name), owner, now,
        )  # fmt: skip

    def do_check(self, name: str, owner: str) -> bool:
        row = self._run(
            "SELECT 1 FROM lease WHERE name = ? AND owner = ? AND expires > ?",
            self._key(name), owner, time.time(),
        ).fetchone()  # fmt: skip
        return row is not None

    def do_break(self, name: str, token: int | None) -> bool:
        sql = "DELETE FROM lease WHERE name = ? AND expires > ?"
        args: list[Any] = [self._key(name), time.time()]
        if token is not None:
            sql, args = sql + " AND token = ?", [*args, token]
        return self._changed(sql, *args)

    def do_get(self, name: str) -> LockInfo | None:
        rows = self._select("name = ?", self._key(name))
        return rows[0] if rows else None

    def do_list(self, prefix: str) -> list[LockInfo]:
        start = self._key(prefix)
        return self._select("substr(name, 1, ?) = ?", len(start), start)

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        return "SQLite " + self._run("SELECT sqlite_version()").fetchone()[0], ()

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    # --- helpers --------------------------------------------------------------------

    def _changed(self, sql: str, *args: Any) -> bool:
        return self._run(sql, *args).rowcount == 1

    def _select(self, where: str, *args: Any) -> list[LockInfo]:
        now = time.time()
        rows = self._run(
            f"SELECT name, token, acquired, expires, holder FROM lease "
            f"WHERE {where} AND expires > ?",
            *args,
            now,
        ).fetchall()
        skip = len(self.key_prefix)
        return [
            LockInfo(
                backend=self.alias,
                name=key[skip:],
                token=token,
                holder=load_holder(holder),
                acquired_at=datetime.fromtimestamp(acquired, timezone.utc),
                expires_at=datetime.fromtimestamp(expires, timezone.utc),
                expires_in=expires - now,
            )
            for key, token, acquired, expires, holder in rows
        ]
