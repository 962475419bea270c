"""The database backend's SQL for mutexes: one set of statements per vendor and table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .sql import BINARY, SERVER_CLOCK

__all__ = ["Statements", "extend_rows", "vendor_statements"]

# The server's version, for `manage.py locks check`.
_VERSION = {
    "mysql": (
        "SELECT CONCAT(IF(LOCATE('MariaDB', VERSION()) > 0, 'MariaDB ', 'MySQL '), VERSION())"
    ),
    "postgresql": "SELECT 'PostgreSQL ' || current_setting('server_version')",
    "sqlite": "SELECT 'SQLite ' || sqlite_version()",
}


@dataclass(frozen=True)
class Statements:
    acquire: str
    acquire_insert: str | None
    release: str
    adopt: str
    extend: str
    extend_owned: str
    extend_many: str
    extended: str | None
    check: str
    break_: str
    break_token: str
    list: str
    get: str
    version: str


def vendor_statements(vendor: str, table: str) -> Statements:
    now = SERVER_CLOCK[vendor]
    binary = BINARY[vendor]
    break_ = (
        f"UPDATE {table} SET owner = NULL, acquired_at_us = NULL, expires_at_us = NULL,"
        f" holder = '' WHERE digest = %s AND expires_at_us > {now}"
    )
    columns = "digest, namespace, name, fence, owner, acquired_at_us, expires_at_us, holder"
    if vendor == "mysql":
        # MySQL has no UPDATE ... RETURNING. LAST_INSERT_ID(expr) stores expr for
        # this connection and the driver reports it as cursor.lastrowid, so the
        # new token comes back with the statement.
        #
        # params: owner, ttl (us), holder JSON, digest
        # returns: rowcount 1 and lastrowid = the new token if the row was free
        #          or expired; rowcount 0 if it is held or does not exist yet.
        acquire = (
            f"UPDATE {table} SET fence = LAST_INSERT_ID(fence + 1), owner = %s,"
            f" acquired_at_us = {now}, expires_at_us = {now} + %s, holder = %s"
            f" WHERE digest = %s AND (owner IS NULL OR expires_at_us <= {now})"
        )
        # The first acquisition of a name. A duplicate key means another client
        # created the row first: that attempt failed.
        #
        # params: digest, namespace, name, owner, ttl (us), holder JSON
        # returns: lastrowid = the token, seeded from the server clock.
        acquire_insert = (
            f"INSERT INTO {table} ({columns})"
            f" VALUES (%s, %s, %s, LAST_INSERT_ID({now}), %s, {now}, {now} + %s, %s)"
        )
    else:
        # One statement: create the row for a new name (the token seeded from
        # the server clock), or take over a free or expired row (token + 1;
        # on SQLite max(token + 1, the clock in us)). If
        # a live lease holds the row the DO UPDATE's WHERE fails and no row
        # comes back. Under concurrency PostgreSQL re-checks the WHERE against
        # the row version that won, and SQLite runs one writer at a time.
        #
        # params: digest, namespace, name, owner, ttl (us), holder JSON
        # returns: one row (the new fencing token) or none.
        seed, next_token = now, f"{table}.fence + 1"
        if vendor == "sqlite":
            # See the module docstring: a rolled-back token is not issued again.
            seed, next_token = "dlock_now_us()", f"MAX({table}.fence + 1, dlock_now_us())"
        acquire = (
            f"INSERT INTO {table} ({columns})"
            f" VALUES (%s, %s, %s, {seed}, %s, {now}, {now} + %s, %s)"
            f" ON CONFLICT (digest) DO UPDATE SET fence = {next_token},"
            " owner = excluded.owner, acquired_at_us = excluded.acquired_at_us,"
            " expires_at_us = excluded.expires_at_us, holder = excluded.holder"
            f" WHERE {table}.owner IS NULL OR {table}.expires_at_us <= excluded.acquired_at_us"
            " RETURNING fence"
        )
        acquire_insert = None
    return Statements(
        acquire=acquire,
        acquire_insert=acquire_insert,
        # Compare-and-release. The fence column is kept so the counter survives.
        # params: digest, owner
        # returns: rowcount 1 if owner held a live lease, else 0.
        release=(
            f"UPDATE {table} SET owner = NULL, acquired_at_us = NULL, expires_at_us = NULL,"
            f" holder = '' WHERE digest = %s AND owner = %s AND expires_at_us > {now}"
        ),
        # Compare-and-move: a handed-over lease changes owner, so that a second
        # adoption of the same ticket finds it gone. The token stays.
        # params: new owner, ttl (us), digest, owner
        # returns: rowcount 1 if owner held a live lease, else 0.
        adopt=(
            f"UPDATE {table} SET owner = %s, expires_at_us = {now} + %s"
            f" WHERE digest = %s AND owner = %s AND expires_at_us > {now}"
        ),
        # Compare-and-extend: the lease runs ttl from now by the server clock.
        # params: ttl (us), digest, owner
        # returns: rowcount 1 if owner held a live lease, else 0.
        extend=(
            f"UPDATE {table} SET expires_at_us = {now} + %s"
            f" WHERE digest = %s AND owner = %s AND expires_at_us > {now}"
        ),
        # SQLite, a lease taken inside a transaction whose renewals were put
        # off while it was open (nobody else could write): ours if nobody took
        # it since, even past its old end. params and returns: as extend.
        extend_owned=(
            f"UPDATE {table} SET expires_at_us = {now} + %s WHERE digest = %s AND owner = %s"
        ),
        # The watchdog's batched renewal: extend for n leases of the same ttl.
        # {digests} is n "%s" and {pairs} n "(%s, %s)", joined by commas (the
        # digest list lets the primary key find the rows).
        # params: ttl (us), the n digests, then each lease's digest and owner
        # returns: the (digest, owner) of each lease extended; on MySQL, which
        #          has no UPDATE ... RETURNING, nothing: `extended` reads them.
        extend_many=(
            f"UPDATE {table} SET expires_at_us = {now} + %s WHERE expires_at_us > {now}"
            " AND digest IN ({digests}) AND (digest, owner) IN ({pairs})"
            + ("" if vendor == "mysql" else " RETURNING digest, owner")
        ),
        # MySQL, right after extend_many: its leases that are live are the ones
        # it extended (a lease it did not extend had run out, or was another
        # owner's). params: the n digests, then the pairs; returns: (digest, owner).
        extended=(
            f"SELECT digest, owner FROM {table} WHERE expires_at_us > {now}"
            " AND digest IN ({digests}) AND (digest, owner) IN ({pairs})"
            if vendor == "mysql"
            else None
        ),
        # params: digest, owner
        # returns: one row if owner holds a live lease, else none.
        check=(
            f"SELECT 1 FROM {table} WHERE digest = %s AND owner = %s AND expires_at_us > {now}"
        ),
        # Break whoever holds it.
        # params: digest
        # returns: rowcount 1 if there was a live lease, else 0.
        break_=break_,
        # Break the live lease only if it is the one with this fencing token
        # (the row's fence is the token of its current lease).
        # params: digest, token
        # returns: rowcount 1 if that lease was live, else 0.
        break_token=f"{break_} AND fence = %s",
        # Live leases in a namespace by name prefix, through the expires_at_us
        # index: the rows read are the live leases, not every name ever locked.
        # params: namespace, len(prefix), prefix
        # returns: name, fence, holder, acquired_at_us, expires_at_us, now_us.
        list=(
            f"SELECT name, fence, holder, acquired_at_us, expires_at_us, {now} FROM {table}"
            f" WHERE expires_at_us > {now}"
            f" AND {binary.format('namespace')} = {binary.format('%s')}"
            f" AND {binary.format('substr(name, 1, %s)')} = {binary.format('%s')}"
        ),
        # The live lease on one name, by its primary key.
        # params: digest
        # returns: one row (the columns of list) if the lease is live, else none.
        get=(
            f"SELECT name, fence, holder, acquired_at_us, expires_at_us, {now} FROM {table}"
            f" WHERE digest = %s AND expires_at_us > {now}"
        ),
        # params: none; returns: one row, the server's name and version.
        version=_VERSION[vendor],
    )


def extend_rows(
    ttl_us: int, pairs: list[tuple[str, str]], connection: Any, sql: Statements, cursor: Any
) -> set[tuple[str, str]]:
    """Run ``extend_many`` for ``pairs`` (digest, owner); the pairs it extended."""
    marks = {"digests": ", ".join(["%s"] * len(pairs))}
    marks["pairs"] = ", ".join(["(%s, %s)"] * len(pairs))
    params = [digest for digest, _ in pairs] + [value for pair in pairs for value in pair]
    cursor.execute(sql.extend_many.format(**marks), [ttl_us, *params])
    if sql.extended is not None:
        cursor.execute(sql.extended.format(**marks), params)
    return {(digest, owner) for digest, owner in cursor.fetchall()}
