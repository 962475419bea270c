"""The database backend: leases in a table, judged by the database server's clock.

Settings::

    "BACKEND": "django_dlock.backends.database.DatabaseBackend",
    "OPTIONS": {"database": "default"},   # the alias in DATABASES (the default)

It is the zero-config default and works on SQLite, PostgreSQL and
MySQL/MariaDB. Each lock name has one row (:class:`~django_dlock.models.Lease`)
that is kept after release, so its ``fence`` column keeps counting and a
fencing token is never issued twice. A new row's counter is seeded from the
server clock in microseconds, so that even if the table is lost and recreated
the next token is larger than any before it.

Which connection runs the statements:

- Outside ``transaction.atomic()``: the thread's own connection, in
  autocommit, so each statement is committed when it returns.
- Inside ``atomic()`` on PostgreSQL or MySQL: a private connection of the
  backend's, in autocommit. A lease must be visible to other processes when
  ``acquire()`` returns, not when the caller's transaction commits, and a
  rollback of the caller's work must not undo a release. It is the
  thread's, opened when first needed in a transaction and closed when that
  transaction commits or rolls back: under ``ATOMIC_REQUESTS`` it ends with
  the request's transaction, in a ``TestCase`` with the test's, so nothing
  is left on a test database that ``manage.py test`` must drop.
- Inside ``atomic()`` on SQLite: the caller's connection, joining its
  transaction. SQLite has one writer at a time, and a second connection
  would wait for the caller's own transaction. Until that transaction ends,
  the lease is bound to the connection, and only the thread that took it
  uses it (CPython's sqlite3 deadlocks two threads sharing a connection
  when a statement calls a Python function): checks and a release on that
  thread run in the transaction. The renewal thread puts the lease's
  renewals off while the transaction is open (no other connection can take
  it meanwhile: SQLite has one writer) and counts them granted; the row is
  renewed on the owner's thread at its next use of the lease and as the
  transaction commits. A release asked for on another thread runs once the
  transaction has ended. A rollback
  undoes the acquisition and reports the lease lost at once
  (``bound.py``).
  Three rules keep this safe:

  - Tokens are ``max(fence + 1, wall clock in us)`` on SQLite (as on Redis),
    so the acquisition after a rolled-back one gets a larger token than the
    one rolled back, not the same one again.
  - Such an acquisition never waits. A refused attempt has taken SQLite's
    write lock for the caller's transaction, so the holder could not even
    release while we waited; and t0 the caller reads (a shared lock), t1
    another process starts a write and waits for that shared lock to go, t2
    the caller's lock statement waits for the other's write: a deadlock.
    Both raise ``LockInTransaction`` (a ``LockTimeout``) at once, whatever
    the timeout; take the lock before ``atomic()`` to wait for it.
  - Uncontended, it just works: a lock in ``ATOMIC_REQUESTS`` views, in the
    admin's save of a ``LockedSaveMixin`` model, in Django's ``TestCase``.

Outside a transaction on SQLite an attempt reads before it writes, in one
deferred transaction: t0 the holder's ``atomic()`` reads (SQLite's shared
lock), t1 a waiter's acquire statement, a write, takes the write lock, t2 the
holder's first write cannot take it and fails at once with "database is
locked" (SQLite does not wait in that case). A waiter that finds a live lease
therefore writes nothing, and no acquisition can commit between its read and
its write.

Waiting backs off exponentially with jitter (2 ms doubling to 100 ms).

Modules: ``backend`` (DatabaseBackend: its mutexes and connections),
``statements`` (the mutexes' SQL for each vendor), ``bound`` (leases bound to
the caller's transaction on SQLite), ``slots`` (semaphores, read/write locks
and parked Celery calls) and ``sql`` (the server clock and bounded row-lock
waits that both share).
"""

from .backend import DatabaseBackend

__all__ = ["DatabaseBackend"]
