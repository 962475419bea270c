"""The database backend under adversity: clocks, transactions, rollbacks (issue 15)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

import pytest
from django.conf import settings
from django.db import connections, transaction

from django_dlock import LockInTransaction, LockTimeout, lock, locks, semaphore
from tests.models import Counter

ZONE = "America/New_York"


def _utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


@pytest.fixture
def new_york_session() -> Iterator[Callable[[str], None]]:
    """The lock connection's session in America/New_York, on a server clock we set.

    MariaDB knows named zones only once their tables are loaded, which
    ``mariadb-tzinfo-to-sql`` does (the zone file is Debian's tzdata).
    """
    zone_file = f"/usr/share/zoneinfo/{ZONE}"
    tool = shutil.which("mariadb-tzinfo-to-sql") or shutil.which("mysql_tzinfo_to_sql")
    client = shutil.which("mariadb") or shutil.which("mysql")
    missing = [what for what, found in [("tzinfo-to-sql", tool), ("client", client)] if not found]
    if missing or not os.path.exists(zone_file):
        reason = f"cannot load MariaDB's time zone tables (missing: {missing or zone_file})"
        if settings.REQUIRE_ALL:
            pytest.fail(reason)
        pytest.skip(reason)
    connection = connections["mysql"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM mysql.time_zone_name WHERE Name = %s", [ZONE])
        loaded = cursor.fetchone()[0] > 0
    if not loaded:
        db = settings.DATABASES["mysql"]
        sql = subprocess.run([tool, zone_file, ZONE], capture_output=True, check=True).stdout
        subprocess.run(
            [
                client, "-h", db["HOST"], "-P", str(db["PORT"]), "-u", db["USER"],
                *([f"-p{db['PASSWORD']}"] if db["PASSWORD"] else []), "mysql",
            ],
            input=sql,
            capture_output=True,
            check=True,
        )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("SET time_zone = %s", [ZONE])

    def at(utc: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SET timestamp = %s", [_utc(utc)])

    yield at
    with connection.cursor() as cursor:
        cursor.execute("SET timestamp = DEFAULT")
        cursor.execute("SET time_zone = DEFAULT")


@pytest.mark.backends("db-mysql")
@pytest.mark.with_default_db  # Django sets up test databases with "default" among them
def test_mariadb_leases_keep_utc_time_across_the_autumn_change(
    backend_alias: str, new_york_session: Callable[[str], None], name: str
) -> None:
    """On 2024-11-03 New York's clocks go from 01:59:59 EDT back to 01:00 EST (06:00 UTC).

    Local times from 01:00 to 02:00 happen twice. A lease judged by local
    time gains or loses an hour across the change.
    """
    at = new_york_session
    backend = locks[backend_alias]
    # A live lease: taken at 01:30 EST (06:30 UTC) for 40 minutes, so until
    # 07:10 UTC. At 07:01 UTC (02:01 EST) it still has 9 minutes.
    at("2024-11-03T06:30:00")
    live = backend.acquire(f"{name}:live", ttl=40 * 60, renew=False)
    at("2024-11-03T07:01:00")
    with pytest.raises(LockTimeout):
        backend.acquire(f"{name}:live", timeout=0)
    [info] = backend.list(f"{name}:live")
    assert round(info.expires_in) == 9 * 60
    # An expired lease: taken at 01:55 EDT (05:55 UTC) for 10 minutes, so
    # until 06:05 UTC. At 07:01 UTC it ended 56 minutes ago.
    at("2024-11-03T05:55:00")
    backend.acquire(f"{name}:stale", ttl=10 * 60, renew=False)
    at("2024-11-03T07:01:00")
    taken = backend.acquire(f"{name}:stale", timeout=0, renew=False)
    taken.release()
    at("2024-11-03T07:02:00")
    live.release()


@pytest.mark.backends("db-postgresql", "db-mysql", "redis")
@pytest.mark.with_default_db
def test_release_on_commit_keeps_a_read_modify_write_whole(backend_alias: str) -> None:
    """``with atomic(): with lock(k): read, add one, write`` from 4 threads, 40 times each.

    A lock on a connection of its own is released when the block ends, before
    the transaction commits: the next holder reads the old value, and updates
    are lost (93 and 101 of 160 were seen). ``release_on_commit=True`` holds it
    until the commit. ("redis" runs it over the SQLite default database. The
    database backend on SQLite cannot wait inside a transaction at all: see
    below.)
    """
    db = settings.CONFORMANCE_BACKENDS[backend_alias] or "default"
    counter = Counter.objects.using(db).create(value=0)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(40):
                with transaction.atomic(using=db):
                    with lock(
                        f"counter:{counter.pk}",
                        backend=backend_alias,
                        timeout=60,
                        release_on_commit=True,
                        using=db,
                    ):
                        row = Counter.objects.using(db).get(pk=counter.pk)
                        row.value += 1
                        row.save(using=db)
        except BaseException as e:
            errors.append(e)
        finally:
            connections[db].close()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert Counter.objects.using(db).get(pk=counter.pk).value == 160
    assert locks[backend_alias].list(f"counter:{counter.pk}") == []


# --- SQLite inside a transaction: joined, never waiting -----------------------------------


@pytest.mark.django_db(transaction=True)
def test_sqlite_lock_inside_a_transaction_joins_it_and_never_waits(name: str) -> None:
    """Uncontended it works (and release_on_commit holds it to the commit); held, it fails fast.

    A refused attempt takes SQLite's write lock for the caller's transaction,
    so the holder could not release while the caller waited: it raises
    LockInTransaction (a LockTimeout) at once, whatever the timeout.
    """
    backend = locks["db-sqlite"]
    with transaction.atomic():
        with lock(name, backend="db-sqlite", release_on_commit=True) as held:
            Counter.objects.create(value=1)
        assert not held.released  # the release waits for the commit
    assert held.released
    assert backend.list(name) == []
    holder = backend.acquire(name, ttl=30)
    try:
        with transaction.atomic():
            with pytest.raises(LockInTransaction, match="before entering the transaction"):
                lock(name, backend="db-sqlite", timeout=20).acquire()
        with pytest.raises(LockTimeout):  # what callers catch, 423 in views, skip in Celery
            with transaction.atomic():
                backend.acquire(name, timeout=0)
        holder.ensure()  # renewed and released through its own connection as usual
    finally:
        holder.release()
    with lock(name, backend="db-sqlite", timeout=0) as again:  # the way to wait: outside
        with transaction.atomic():
            Counter.objects.create(value=2)
        assert again.token > holder.token


_WRITER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)
db.execute("BEGIN IMMEDIATE")  # the write lock, as a lock write of another process takes it
db.execute("UPDATE django_dlock_lease SET holder = holder WHERE 0")
print("writing", flush=True)
db.execute("COMMIT")  # waits for every reader to finish: our caller's transaction too
print("committed", flush=True)
"""


@pytest.mark.django_db(transaction=True)
def test_sqlite_lock_after_a_read_in_a_transaction_does_not_deadlock(name: str) -> None:
    """Issue 15: ``acquire()`` inside ``atomic()`` after a read deadlocked with another process.

    t0 the caller reads (SQLite's shared lock), t1 another process takes the
    write lock and, to commit, waits for the caller's shared lock, t2 the
    caller's lock statement waits for the other's write. The caller got
    LockTimeout after 8 s on a lock nobody held, and the other process waited
    as long. Now the caller is told at once, and the other process commits
    as soon as the caller's transaction ends.
    """
    import subprocess
    import sys

    path = str(connections["default"].settings_dict["NAME"])
    writer = None
    try:
        with pytest.raises(LockInTransaction, match="before entering the transaction"):
            with transaction.atomic():
                Counter.objects.count()  # the read: a shared lock until the end
                writer = subprocess.Popen(
                    [sys.executable, "-c", _WRITER, path], stdout=subprocess.PIPE, text=True
                )
                assert writer.stdout is not None
                assert writer.stdout.readline().strip() == "writing"
                lock(name, backend="db-sqlite", timeout=8).acquire()
        assert writer.stdout.readline().strip() == "committed"
        assert writer.wait(timeout=30) == 0
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
    assert locks["db-sqlite"].list(name) == []
    with lock(name, backend="db-sqlite", timeout=0):  # the way to write it
        with transaction.atomic():
            Counter.objects.create(value=1)


@pytest.mark.django_db(transaction=True)
def test_sqlite_tokens_never_repeat_after_a_rollback(name: str) -> None:
    """Issue 15: inside atomic() the fence counter joined the caller's transaction."""
    backend = locks["db-sqlite"]
    with backend.acquire(name, timeout=0) as before:
        pass
    issued: list[int] = []

    class Rollback(Exception):
        pass

    with contextlib.suppress(Rollback, LockInTransaction), transaction.atomic():
        held = backend.acquire(name, timeout=0)
        issued.append(held.token)
        raise Rollback
    with backend.acquire(name, timeout=0) as after:
        assert after.token > before.token
        assert after.token not in issued


@pytest.mark.django_db  # Django's TestCase transactions, as a test suite uses them
def test_sqlite_locks_work_inside_a_test_cases_transaction(name: str) -> None:
    with lock(name, backend="db-sqlite", timeout=0) as held:
        held.ensure()
        assert [i.token for i in locks["db-sqlite"].list(name)] == [held.token]
    assert locks["db-sqlite"].list(name) == []


@pytest.mark.backends("db-postgresql", "db-mysql")
@pytest.mark.with_default_db
def test_release_on_commit_after_a_rollback_leaves_the_connection_usable(
    backend_alias: str, name: str
) -> None:
    """Review of issue 15: the release ran inside Django's rollback, on the caller's connection.

    On PostgreSQL the release then opened a transaction that was never
    committed, and leaving atomic() raised ProgrammingError instead of the
    body's error.
    """
    db = settings.CONFORMANCE_BACKENDS[backend_alias]
    with pytest.raises(RuntimeError, match="roll back"):
        with transaction.atomic(using=db):
            with lock(name, backend=backend_alias, release_on_commit=True, using=db):
                Counter.objects.using(db).create(value=1)
            raise RuntimeError("roll back")
    assert connections[db].get_autocommit()
    assert not connections[db].in_atomic_block
    # Released on the backend's renewal thread, just after the rollback.
    with lock(name, backend=backend_alias, timeout=10) as again:
        again.ensure()
    assert not Counter.objects.using(db).exists()


@pytest.mark.django_db(transaction=True)
def test_release_on_commit_reports_a_lease_lost_inside_the_block(name: str) -> None:
    """Review of issue 15: leaving the block deferred the release and so never noticed."""
    from django_dlock import LockLost

    with pytest.raises(LockLost), transaction.atomic():
        with lock(name, backend="locmem", release_on_commit=True):
            Counter.objects.create(value=1)
            locks["locmem"].break_lock(name)
    assert not Counter.objects.exists()  # the transaction rolled back


@pytest.mark.django_db  # inside Django TestCase's transactions, which never commit
def test_release_on_commit_in_a_test_case_releases_at_once(name: str) -> None:
    """Review of issue 15: the test's own transaction held the lock until the test ended."""

    def work() -> int:
        with lock(name, backend="locmem", release_on_commit=True, timeout=0) as held:
            return held.token

    assert work() < work()  # the second call finds the lock free


@pytest.mark.django_db  # inside Django TestCase's transactions, which never commit
def test_release_on_commit_in_an_atomic_inside_a_test_case_releases_with_the_block(
    name: str,
) -> None:
    """Issue 27: an ``atomic()`` inside a TestCase is a savepoint that never commits.

    The realistic project's TestCase called a view doing ``with atomic(using=
    "ledger"): with lock(..., release_on_commit=True)`` twice; the second call
    waited for a commit that never comes and raised LockTimeout.
    """

    def work() -> int:
        with transaction.atomic():
            with lock(name, backend="locmem", release_on_commit=True, timeout=0) as held:
                Counter.objects.create(value=1)
                return held.token

    assert work() < work()  # the second call finds the lock free


# --- semaphores ------------------------------------------------------------------------


@pytest.mark.backends("db-sqlite", "db-postgresql", "db-mysql")
def test_racing_acquirers_never_exceed_a_semaphores_limit(backend_alias: str, name: str) -> None:
    """Six threads try a semaphore of 2 at once, 40 times each, on their own connections.

    Counting the holders and inserting one must be one step per name: t0 A
    counts 1 holder, t1 B counts 1 holder, t2 A inserts, t3 B inserts, and
    three hold a semaphore of two. The acquisition locks the name's fence row
    first, so B counts after A's insert is committed.
    """
    inside, most, tokens = 0, 0, []
    mutex = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def work() -> None:
        nonlocal inside, most
        try:
            start.wait()
            for _ in range(40):
                try:
                    held = semaphore(name, limit=2, backend=backend_alias, timeout=0).acquire()
                except LockTimeout:
                    continue
                with mutex:
                    inside += 1
                    most = max(most, inside)
                    tokens.append(held.token)
                time.sleep(0.001)
                with mutex:
                    inside -= 1
                held.release()
        except BaseException as e:
            errors.append(e)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    print(f"\n[{backend_alias}] {len(tokens)} grants, most inside at once = {most}")
    assert most <= 2
    assert len(set(tokens)) == len(tokens) > 0
    assert locks[backend_alias].semaphores(name) == []


@pytest.mark.backends("db-postgresql", "db-mysql")
@pytest.mark.with_default_db
def test_a_rollback_around_a_slot_acquisition_changes_no_token(
    backend_alias: str, name: str
) -> None:
    """Guarantee 10: the slot is taken on the backend's own connection, not in the transaction.

    The rollback of the caller's work leaves the slot held (and its fence
    counter advanced): the next acquisition gets a larger token.
    """
    db = settings.CONFORMANCE_BACKENDS[backend_alias]
    backend = locks[backend_alias]

    class Rollback(Exception):
        pass

    with contextlib.suppress(Rollback), transaction.atomic(using=db):
        Counter.objects.using(db).create(value=1)
        held = semaphore(name, limit=2, backend=backend_alias, timeout=0).acquire()
        raise Rollback
    assert not Counter.objects.using(db).exists()
    held.ensure()  # the rollback did not undo the acquisition
    assert [h.token for h in backend.semaphores(name)[0].holders] == [held.token]
    with semaphore(name, limit=2, backend=backend_alias, timeout=0) as after:
        assert after.token > held.token
    held.release()


@pytest.mark.django_db(transaction=True)
def test_sqlite_slots_inside_atomic_join_the_callers_transaction(name: str) -> None:
    """On SQLite a slot taken inside ``atomic()`` joins the caller's transaction, as the mutex.

    Its rollback removes the slot (the handle finds it lost) and no token
    repeats. A full semaphore raises LockInTransaction at once, whatever the
    timeout (tests/test_database_sqlite_slots.py has the rest).
    """
    from django_dlock import LockLost
    from tests.models import Counter

    class Rollback(Exception):
        pass

    with contextlib.suppress(Rollback), transaction.atomic():
        held = semaphore(name, limit=1, backend="db-sqlite", timeout=0).acquire()
        raise Rollback
    with pytest.raises(LockLost):
        held.ensure()
    holder = semaphore(name, limit=1, backend="db-sqlite", timeout=0).acquire()
    assert holder.token > held.token
    started = time.monotonic()
    with transaction.atomic():
        Counter.objects.create(value=1)
        with pytest.raises(LockInTransaction):
            semaphore(name, limit=1, backend="db-sqlite", timeout=10).acquire()
    assert time.monotonic() - started < 4
    holder.release()
    with semaphore(name, limit=1, backend="db-sqlite", timeout=0) as after:
        assert after.token > holder.token


@pytest.mark.backends("db-postgresql", "db-mysql")
@pytest.mark.with_default_db
def test_two_unparks_never_take_the_same_task(backend_alias: str, name: str) -> None:
    """Each parked task is sent again once: unparking locks the name's fence row."""
    backend = locks[backend_alias]
    for n in range(60):
        backend.do_park(name, f"task-{n}", n, "{}")
    taken: list[str] = []
    mutex = threading.Lock()

    def work() -> None:
        try:
            while got := backend.do_unpark(name, 3):
                with mutex:
                    taken.extend(p.key for p in got)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(taken) == sorted(f"task-{n}" for n in range(60))


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_slot_released_inside_atomic_after_a_write_keeps_the_work(name: str) -> None:
    """``with atomic(): with semaphore(...): write`` on SQLite (Django's default settings).

    Found by review: the release at the end of the block could not write
    (the caller's transaction holds SQLite's write lock) and raised
    LockInTransaction, which rolled the caller's work back. The slot now joins
    the caller's transaction and is released in it.
    """
    from tests.models import Counter

    with transaction.atomic():
        with semaphore(name, limit=1, backend="db-sqlite", timeout=0):
            Counter.objects.create(value=7)
    assert Counter.objects.filter(value=7).exists()
    deadline = time.monotonic() + 5
    while locks["db-sqlite"].semaphores(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    with semaphore(name, limit=1, backend="db-sqlite", timeout=0):
        pass


@pytest.mark.backends("db-mysql")
@pytest.mark.with_default_db  # Django sets up test databases with "default" among them
def test_a_string_a_utf8mb3_table_cannot_hold_is_not_retried_as_an_outage(
    backend_alias: str,
) -> None:
    """Second review of issue 30: a name with a 4-byte character on a utf8mb3 database.

    MariaDB refuses it with error 1366 every time; the backend took it for an
    outage and retried until the timeout (with none, for ever). The error is
    the server's own, from a utf8mb3 column made for the test.
    """
    from django.db import DatabaseError

    backend = locks[backend_alias]
    connection = connections["mysql"]
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION sql_mode = 'STRICT_ALL_TABLES'")
        cursor.execute("CREATE TEMPORARY TABLE dlock_mb3 (name VARCHAR(20) CHARACTER SET utf8mb3)")
        try:
            with pytest.raises(DatabaseError) as raised:
                cursor.execute("INSERT INTO dlock_mb3 VALUES (%s)", ["invoice:\U0001f512"])
        finally:
            cursor.execute("DROP TEMPORARY TABLE dlock_mb3")
    assert raised.value.args[0] == 1366, raised.value.args
    error = backend._unavailable(connection, "invoice:\U0001f512", raised.value)
    assert error.transient is False
    assert "utf8mb4" in str(error)
