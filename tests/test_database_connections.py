"""The database backend's connections end with the transactions that need them (issue 27)."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import pytest
from django.conf import settings
from django.db import connections, transaction

from django_dlock import LockInTransaction, LockTimeout, lock, locks, rwlock, semaphore
from django_dlock.backends.database import DatabaseBackend
from django_dlock.backends.types import BoundElsewhere
from django_dlock.signals import lock_lost
from tests.models import Counter

_SESSION_ID = {"postgresql": "SELECT pg_backend_pid()", "mysql": "SELECT CONNECTION_ID()"}
_SESSION_ALIVE = {
    "postgresql": "SELECT 1 FROM pg_stat_activity WHERE pid = %s",
    "mysql": "SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = %s",
}


class Rollback(Exception):
    pass


def _private_session(backend: DatabaseBackend) -> int:
    """The server's id of the backend's private connection on this thread."""
    private = backend._local.connection
    with private.cursor() as cursor:
        cursor.execute(_SESSION_ID[private.vendor])
        return int(cursor.fetchone()[0])


def _alive(db: str, session: int) -> bool:
    with connections[db].cursor() as cursor:
        cursor.execute(_SESSION_ALIVE[connections[db].vendor], [session])
        return cursor.fetchone() is not None


def _gone(db: str, session: int) -> bool:
    """Whether the server has no session ``session`` (the server ends it soon after the close)."""
    deadline = time.monotonic() + 10
    while _alive(db, session) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(db, session)


@pytest.mark.backends("db-postgresql", "db-mysql")
@pytest.mark.with_default_db
@pytest.mark.parametrize("ending", ["commit", "rollback", "savepoint then commit"])
def test_the_private_connection_closes_when_the_transaction_ends(
    backend_alias: str, name: str, ending: str
) -> None:
    """Issue 27: inside atomic() the backend locked on a private connection nobody closed.

    Under ATOMIC_REQUESTS they piled up (27 idle after 40 requests), and a
    TestCase left one on the test database, so that `manage.py test` could
    not drop it. It is now closed when the transaction that needed it ends;
    a savepoint rolled back inside the transaction leaves it open.
    """
    db = settings.CONFORMANCE_BACKENDS[backend_alias]
    backend = locks[backend_alias]
    assert isinstance(backend, DatabaseBackend)
    with contextlib.suppress(Rollback), transaction.atomic(using=db):
        if ending == "savepoint then commit":
            with contextlib.suppress(Rollback), transaction.atomic(using=db):
                with lock(name, backend=backend_alias, timeout=0):
                    session = _private_session(backend)
                raise Rollback
            assert _alive(db, session)  # kept for the rest of the transaction
            with semaphore(name, limit=2, backend=backend_alias, timeout=0):
                assert _private_session(backend) == session
        else:
            with lock(name, backend=backend_alias, timeout=0):
                Counter.objects.using(db).create(value=1)
                session = _private_session(backend)
            if ending == "rollback":
                raise Rollback
    assert _gone(db, session)
    assert getattr(backend._local, "connection", None) is None
    with transaction.atomic(using=db), lock(name, backend=backend_alias, timeout=0):
        assert _private_session(backend) != session  # a new one, closed in turn
    assert backend.list(name) == []


@pytest.mark.backends("db-postgresql", "db-mysql")
@pytest.mark.with_default_db
def test_a_failing_on_commit_hook_of_the_app_does_not_keep_the_private_connection(
    backend_alias: str, name: str
) -> None:
    """Issue 27 review: Django stops at the first failing hook; the close was queued behind it."""
    db = settings.CONFORMANCE_BACKENDS[backend_alias]
    backend = locks[backend_alias]
    assert isinstance(backend, DatabaseBackend)
    kept: list[BaseException] = []

    def send_mail() -> None:
        raise RuntimeError("the mail server is down")

    try:
        with transaction.atomic(using=db):
            transaction.on_commit(send_mail, using=db)
            with lock(name, backend=backend_alias, timeout=0):
                session = _private_session(backend)
    except RuntimeError as e:
        kept.append(e)  # with its traceback, as an error reporter keeps it
    assert len(kept) == 1
    assert _gone(db, session)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_sqlite_a_lease_handed_over_inside_atomic_leaves_no_binding(
    name: str, ending: str
) -> None:
    """Issue 27 (item 12): a queue-scope enqueue inside atomic() on SQLite.

    The lease, taken on the caller's connection, is bound to it until the
    transaction ends; handed over as a ticket it is never released here, and
    its entry stayed in the backend's map (and the connection shared with
    other threads) for the life of the process.
    """
    backend = locks["db-sqlite"]
    assert isinstance(backend, DatabaseBackend)
    ticket = None
    with contextlib.suppress(Rollback), transaction.atomic():
        held = lock(name, backend="db-sqlite", timeout=0).acquire()
        assert held.owner in backend._bound
        ticket = held.detach()
        if ending == "rollback":
            raise Rollback
    assert backend._bound == {}
    assert not connections["default"].allow_thread_sharing
    assert backend.release_ticket(ticket) is (ending == "commit")
    with lock(name, backend="db-sqlite", timeout=0):
        pass


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_slot_inside_atomic_after_a_read_is_granted_or_refused_at_once(
    name: str,
) -> None:
    """Issue 27 (item 9): after a mere read, a slot blocked 70 s on timeout=0.

    The private connection's COMMIT waited for the caller's shared lock,
    failed, and left its transaction open; every retry then failed with
    "cannot start a transaction within a transaction", and BackendUnavailable
    came 70 s later. Then (review of issue 27) it was refused at once even
    when free. It now joins the caller's transaction as the mutex does: a
    free slot is granted, a full one refused with LockInTransaction at once,
    whatever the timeout.
    """
    for make in (
        lambda: semaphore(name, limit=1, backend="db-sqlite", timeout=0),
        lambda: semaphore(name, limit=1, backend="db-sqlite", timeout=30),
        lambda: rwlock(name, backend="db-sqlite", timeout=30).write(),
    ):
        with transaction.atomic():
            Counter.objects.count()  # a read: SQLite's shared lock until the end
            with make():
                pass
    holder = semaphore(name, limit=1, backend="db-sqlite", timeout=0).acquire()
    try:
        with transaction.atomic():
            Counter.objects.count()
            with pytest.raises(LockInTransaction, match="before entering"):
                semaphore(name, limit=1, backend="db-sqlite", timeout=30).acquire()
    finally:
        holder.release()
    assert locks["db-sqlite"].semaphores(name) == []


def _statement_threads(db: str) -> Any:
    """A context recording the thread of every statement run on ``db``'s connection here."""
    seen: set[int] = set()

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.add(threading.get_ident())
        return execute(sql, params, many, context)

    return seen, connections[db].execute_wrapper(record)


def _on_another_thread(fn: Any) -> Any:
    """``fn()`` on a thread of its own; what it returned or raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return out[0]


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_lease_inside_atomic_is_reached_only_from_its_own_thread(name: str) -> None:
    """CI hung for an hour: the renewal thread ran statements on the caller's connection.

    A lease taken inside atomic() on SQLite lives in the caller's
    transaction; its release after a savepoint rolled back went to the
    renewal thread, which used that same connection. CPython's sqlite3 binds
    parameters holding the GIL and waiting for the connection's mutex, while
    the caller's statement held the mutex and waited for the GIL to call our
    clock function: both threads stopped for good. No other thread may now
    run a statement on it: a renewal is put off until the transaction
    commits, and a release runs when it ends.
    """
    backend = locks["db-sqlite"]
    assert isinstance(backend, DatabaseBackend)

    def take() -> Any:
        return lock(name, backend="db-sqlite", timeout=0, release_on_commit=True)

    seen, recording = _statement_threads("default")
    with recording, transaction.atomic():
        with contextlib.suppress(Rollback), transaction.atomic(), take() as rolled_back:
            raise Rollback  # its release goes to the renewal thread
        deadline = time.monotonic() + 10
        while not rolled_back.released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rolled_back.released
        with take() as held:  # the rollback undid the first lease: free again
            assert held.token > rolled_back.token
            renewal = _on_another_thread(
                lambda: held.backend.do_extend_many([(held.name, held.owner, 30.0)])
            )
            assert renewal == [True]  # put off to the commit: nobody else can write
            assert isinstance(_on_another_thread(held.ensure), BoundElsewhere)
            Counter.objects.create(value=1)
    assert seen == {threading.get_ident()}
    assert held.released
    assert backend._bound == {}
    assert not connections["default"].allow_thread_sharing


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("ending", ["commit", "rollback"])
@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_sqlite_a_lease_inside_atomic_released_from_another_thread_is_released_at_the_end(
    name: str, ending: str, kind: str
) -> None:
    """Renewed and released on another thread: put off until the transaction ends.

    The release then runs on a connection of its own; until then no other
    connection can take the lease (SQLite has one writer).
    """
    backend = locks["db-sqlite"]

    def take() -> Any:
        if kind == "mutex":
            return lock(name, backend="db-sqlite", timeout=0)
        return semaphore(name, limit=1, backend="db-sqlite", timeout=0)

    def held_now() -> bool:
        if kind == "mutex":
            return backend.get(name) is not None
        return bool(backend.semaphores(name))

    seen, recording = _statement_threads("default")
    with recording, contextlib.suppress(Rollback), transaction.atomic():
        held = take().acquire()
        Counter.objects.create(value=1)
        assert _on_another_thread(lambda: held.extend(30)) is None  # put off to the commit
        assert _on_another_thread(held.release) is None
        assert held.released
        if ending == "rollback":
            raise Rollback
    assert seen == {threading.get_ident()}
    deadline = time.monotonic() + 10
    while held_now() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not held_now()
    with take() as again:
        assert again.token > held.token


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_sqlite_a_lease_inside_a_transaction_longer_than_its_ttl_is_kept(
    name: str, kind: str
) -> None:
    """The newcomer's test: a lock held inside the test's transaction past its TTL.

    Renewals are put off while the transaction is open (nobody else can
    write then), the handle keeps its lease, and the commit renews the row
    on the owner's thread before any other process can take it.
    """
    backend = locks["db-sqlite"]

    def take() -> Any:
        if kind == "mutex":
            return lock(name, backend="db-sqlite", ttl=0.5, timeout=0)
        return semaphore(name, limit=1, backend="db-sqlite", ttl=0.5, timeout=0)

    seen, recording = _statement_threads("default")
    with recording:
        with transaction.atomic():
            Counter.objects.create(value=1)
            held = take().acquire()
            time.sleep(1.6)  # three TTLs: renewals come from the renewal thread
            held.ensure()
        assert not held.lost
        # Renewed at the commit: not free.
        assert isinstance(_on_another_thread(lambda: take().acquire()), LockTimeout)
        time.sleep(0.7)  # and renewed by the renewal thread from now on
        held.ensure()
        held.release()
    assert seen == {threading.get_ident()}
    assert backend._bound == {}


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_renewal_undone_by_a_savepoint_is_made_again_at_the_commit(name: str) -> None:
    """Review of issue 28: ensure() in a savepoint renewed the row; the rollback undid it.

    The renewal put off was then counted done, the commit made a row that
    had run out visible, and another process took the lock while the
    handle still said it held.
    """
    take = functools.partial(lock, name, backend="db-sqlite", ttl=0.5, timeout=0)
    with transaction.atomic():
        held = take().acquire()
        time.sleep(1.6)  # renewals put off, three TTLs long
        with contextlib.suppress(Rollback), transaction.atomic():
            held.ensure()  # runs the renewal put off, inside the savepoint
            raise Rollback
    assert isinstance(_on_another_thread(lambda: take().acquire()), LockTimeout)
    held.ensure()
    held.release()


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_lease_kept_past_its_ttl_in_a_transaction_is_renewed_at_the_commit(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28 item 11: the renewal owed at the commit was lost to a race with it.

    As the transaction ended, the renewal thread found it no longer open,
    unbound the lease itself and dropped the renewal owed, before the commit
    hook could make it; its own renewal then found the row run out. Another
    thread took the lock while the handle said it held. The commit is slowed
    down here (a slow fsync) so that a renewal falls between the COMMIT and
    the hooks every time.
    """
    connection = connections["default"]
    commit = connection._commit

    def slow_commit() -> None:
        commit()
        time.sleep(0.5)  # past the next renewal (a third of the TTL)

    monkeypatch.setattr(connection, "_commit", slow_commit)
    take = functools.partial(lock, name, backend="db-sqlite", ttl=1, timeout=0)
    with transaction.atomic():
        held = take().acquire()
        time.sleep(1.5)  # renewals put off; nothing on this thread uses the lease
    monkeypatch.undo()
    # Another process took it here: the row had run out at the commit.
    assert isinstance(_on_another_thread(lambda: take().acquire()), LockTimeout)
    time.sleep(1.2)  # the renewal thread's renewals after the commit are granted
    assert not held.lost
    held.ensure()
    held.release()


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_lease_taken_in_a_transaction_that_rolls_back_is_lost_at_once(
    name: str,
) -> None:
    """Issue 28: the rollback undid the lease's row, and the handle said it held until
    its next renewal (a third of the TTL later), while another process could take it."""
    lost: list[str] = []

    def on_lost(sender: Any, reason: str = "", **kwargs: Any) -> None:
        lost.append(reason)

    lock_lost.connect(on_lost)
    try:
        with contextlib.suppress(Rollback), transaction.atomic():
            held = lock(name, backend="db-sqlite", ttl=30, timeout=0).acquire()
            raise Rollback
        assert held.lost
        with lock(name, backend="db-sqlite", timeout=0):  # free: the row went with the rollback
            pass
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lost == ["the transaction it was taken in rolled back"]
    finally:
        lock_lost.disconnect(on_lost)


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_write_transaction_longer_than_a_ttl_holds_up_the_renewals(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A documented limit (docs/backends/database.md): SQLite has one writer.

    While a transaction holds the write lock, no renewal of that database can
    be written: a lease held outside the transaction, with a TTL shorter than
    it, is reported lost (nobody else could take it meanwhile either). The
    watchdog's warning names this cause; it said only "the process was paused,
    or it holds more leases than it can renew".
    """
    other = lock(f"{name}-other", backend="db-sqlite", ttl=0.6, timeout=0).acquire()
    time.sleep(0.1)  # renewed in a later round, which cannot be sent meanwhile
    later = lock(f"{name}-later", backend="db-sqlite", ttl=0.6, timeout=0).acquire()
    with caplog.at_level("WARNING", logger="django_dlock"):
        with transaction.atomic():
            Counter.objects.create(value=1)  # this transaction holds SQLite's write lock
            time.sleep(1.5)
        assert other.lost and later.lost
        # Reported once the held-up round comes back, after the commit.
        deadline = time.monotonic() + 5
        while "falling behind" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "a transaction holding the database's write lock" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_sqlite_a_lease_taken_by_another_at_the_commit_is_lost_before_the_caller_resumes(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of issue 28: the commit's renewal found the lease taken, and told nobody.

    The handle to mark lost was looked for among the leases scheduled for
    renewal, which left out those whose renewal was queued or in flight. Here
    another connection takes the lock between the COMMIT and the hooks (a
    slow fsync): the row had run out while the transaction was open.
    """
    connection = connections["default"]
    commit = connection._commit
    taken: list[Any] = []
    take = functools.partial(lock, name, backend="db-sqlite", ttl=1, timeout=0)

    def slow_commit() -> None:
        commit()
        time.sleep(0.4)  # renewals fall here: queued, then in flight
        taken.append(_on_another_thread(lambda: take().acquire()))

    monkeypatch.setattr(connection, "_commit", slow_commit)
    with transaction.atomic():
        held = take().acquire()
        time.sleep(1.5)  # the row runs out; renewals are put off
    monkeypatch.undo()
    [other] = taken
    assert not isinstance(other, Exception), other
    assert held.lost  # before the caller's next line, not at a later renewal
    other.release()
