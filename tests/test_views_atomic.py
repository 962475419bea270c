"""Guarded views under ATOMIC_REQUESTS hold their lock until the request's transaction ends.

Issue 27: ``@lock_view`` and ``LockRequiredMixin`` released when the view
returned, before Django committed the request's transaction. The next
request read the value before it was committed, and 40 concurrent
increments ended at 24 to 39. These tests send real concurrent requests
from threads (each with its own connections) through Django's test client,
with ``ATOMIC_REQUESTS`` switched on for the databases involved.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.handlers.base import BaseHandler
from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse
from django.test import Client, RequestFactory

from django_dlock import LockTimeout, lock, locks
from django_dlock.saves import instance_lock_name
from django_dlock.views import lock_view
from tests import views_atomic
from tests.models import Counter, Document, LockedDocument
from tests.test_fencing import held_by_another_thread

pytestmark = pytest.mark.urls("tests.views_atomic")

THREADS = 4
REQUESTS = 6


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Switch ATOMIC_REQUESTS on for these database aliases, for this test."""

    def switch_on(*aliases: str) -> None:
        for alias in aliases:
            monkeypatch.setitem(connections.settings[alias], "ATOMIC_REQUESTS", True)

    return switch_on


def _close_connections() -> None:
    for connection in connections.all(initialized_only=True):
        connection.close()
    for backend in locks.all(initialized_only=True):
        if backend.uses_django_connections:
            backend.close()  # its private connection, taken inside atomic()


def _increment_concurrently(url: str) -> tuple[list[int], list[BaseException]]:
    """THREADS threads POST ``url`` REQUESTS times each; the status codes and errors."""
    statuses: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        client = Client()
        try:
            for _ in range(REQUESTS):
                statuses.append(client.post(url).status_code)
        except BaseException as e:
            errors.append(e)
        finally:
            _close_connections()

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not [t for t in threads if t.is_alive()], "a request thread is still running"
    return statuses, errors


CASES = [
    # (lock backend, database of the counter, kind of view)
    ("db-postgresql", "postgresql", "function"),
    ("db-postgresql", "postgresql", "class"),
    ("db-postgresql", "postgresql", "slot"),
    ("db-mysql", "mysql", "function"),
    ("db-mysql", "mysql", "slot"),
    ("redis", "postgresql", "function"),
    ("redis", "postgresql", "class"),
    ("redis", "postgresql", "slot"),
    ("redis", "mysql", "function"),
    ("redis", "default", "function"),
]


def _case(backend: str, db: str, kind: str) -> Any:
    reason = settings.UNAVAILABLE_BACKENDS.get(backend) or settings.UNAVAILABLE_BACKENDS.get(
        f"db-{db}"
    )
    marks: list[Any] = [pytest.mark.django_db(transaction=True, databases=sorted({db, "default"}))]
    if reason:
        marks = [pytest.mark.skip(reason=reason)]
    return pytest.param(backend, db, kind, marks=marks, id=f"{kind}-{backend}-{db}")


@pytest.mark.parametrize(("backend", "db", "kind"), [_case(*c) for c in CASES])
def test_concurrent_increments_through_a_guarded_view_lose_nothing(
    backend: str, db: str, kind: str, atomic_requests: Callable[..., None], request: Any
) -> None:
    """4 threads x 6 requests: the counter ends at 24, every answer 200.

    Before the fix (a893e4f): 12 to 14 of 24 on PostgreSQL and MariaDB, with
    the database and the Redis backends; on SQLite, 500s ("database is
    locked"). ``slot`` is ``limit=1``: a semaphore's slot is held to the
    commit too. (The database backend on SQLite is not here: inside the
    request's transaction it cannot wait, and answers 423 at once; see
    docs/backends/database.md.)
    """
    if backend == "redis":
        request.getfixturevalue("redis_servers")
    atomic_requests(db)
    counter = Counter.objects.using(db).create(value=0)
    statuses, errors = _increment_concurrently(f"/{kind}/{backend}/{db}/{counter.pk}/")
    assert errors == []
    assert sorted(set(statuses)) == [200]
    assert Counter.objects.using(db).get(pk=counter.pk).value == THREADS * REQUESTS
    name = f"counter:{counter.pk}"
    if kind == "slot":
        assert all(not info.holders for info in locks[backend].semaphores(name))
    else:
        assert locks[backend].list(name) == []


def _held_elsewhere(name: str, backend: str) -> bool:
    """Whether another thread finds ``name`` held (with ``timeout=0``)."""
    found: list[bool] = []

    def attempt() -> None:
        try:
            with lock(name, backend=backend, timeout=0):
                found.append(False)
        except LockTimeout:
            found.append(True)
        finally:
            _close_connections()

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(timeout=30)
    return found[0]


def _observed(
    view: Callable[..., Any], name: str, backend: str, seen: list[bool]
) -> Callable[..., Any]:
    """``view``, then record whether the lock is still held, before the transaction ends."""

    def observe(*args: Any, **kwargs: Any) -> Any:
        response = view(*args, **kwargs)
        seen.append(_held_elsewhere(name, backend))
        return response

    return observe


@pytest.mark.django_db(transaction=True, databases=["default", "postgresql"])
@pytest.mark.skipif(
    "db-postgresql" in settings.UNAVAILABLE_BACKENDS,
    reason=settings.UNAVAILABLE_BACKENDS.get("db-postgresql", ""),
)
@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_with_two_atomic_databases_the_lock_is_held_until_both_end(
    outcome: str, atomic_requests: Callable[..., None]
) -> None:
    """Django nests the request's atomic blocks: default's commits first, then postgresql's.

    The lock is held after default's commit, until postgresql's ends too,
    by a commit or a rollback.
    """
    atomic_requests("default", "postgresql")
    name = "two-databases:1"
    seen: list[bool] = []

    @lock_view("two-databases:{n}", backend="locmem")
    def guarded(request: HttpRequest, n: int) -> HttpResponse:
        assert connections["default"].in_atomic_block
        assert connections["postgresql"].in_atomic_block
        Counter.objects.create(value=1)
        Counter.objects.using("postgresql").create(value=1)
        if outcome == "rollback":
            transaction.set_rollback(True, using="postgresql")
        return HttpResponse("ok")

    # What make_view_atomic builds for the two aliases, with a look at the
    # lock after default's commit, before postgresql's.
    inner = transaction.atomic(using="default")(guarded)
    view = transaction.atomic(using="postgresql")(_observed(inner, name, "locmem", seen))
    assert view(RequestFactory().post("/"), n=1).status_code == 200
    assert seen == [True]  # default committed, postgresql not yet: still held
    assert not _held_elsewhere(name, "locmem")
    assert Counter.objects.count() == 1
    assert Counter.objects.using("postgresql").count() == (1 if outcome == "commit" else 0)
    # And Django's own wrapping, for both aliases, does the same.
    wrapped = BaseHandler().make_view_atomic(guarded)
    assert wrapped(RequestFactory().post("/"), n=1).status_code == 200
    assert not _held_elsewhere(name, "locmem")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("release_on_commit", [True, False])
def test_release_on_commit_false_releases_when_the_view_returns(
    release_on_commit: bool, atomic_requests: Callable[..., None]
) -> None:
    atomic_requests("default")
    seen: list[bool] = []

    @lock_view("unheld:{n}", backend="locmem", release_on_commit=release_on_commit)
    def guarded(request: HttpRequest, n: int) -> HttpResponse:
        Counter.objects.create(value=1)
        return HttpResponse("ok")

    view = BaseHandler().make_view_atomic(_observed(guarded, "unheld:1", "locmem", seen))
    assert view(RequestFactory().post("/"), n=1).status_code == 200
    assert seen == [release_on_commit]
    assert not _held_elsewhere("unheld:1", "locmem")


@pytest.mark.django_db(transaction=True)
def test_a_view_that_raises_under_atomic_requests_releases_at_the_rollback(
    atomic_requests: Callable[..., None],
) -> None:
    atomic_requests("default")
    seen: list[bool] = []

    @lock_view("raises:{n}", backend="locmem")
    def guarded(request: HttpRequest, n: int) -> HttpResponse:
        Counter.objects.create(value=1)
        raise RuntimeError("the view failed")

    def observe(*args: Any, **kwargs: Any) -> Any:
        try:
            return guarded(*args, **kwargs)
        finally:
            seen.append(_held_elsewhere("raises:1", "locmem"))

    view = BaseHandler().make_view_atomic(observe)
    with pytest.raises(RuntimeError, match="the view failed"):
        view(RequestFactory().post("/"), n=1)
    assert seen == [True]  # until the rollback
    assert not _held_elsewhere("raises:1", "locmem")
    assert not Counter.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_lease_lost_while_the_view_ran_rolls_the_request_back(
    atomic_requests: Callable[..., None],
) -> None:
    from django_dlock import LockLost

    atomic_requests("default")

    @lock_view("lost:{n}", backend="locmem")
    def guarded(request: HttpRequest, n: int) -> HttpResponse:
        Counter.objects.create(value=1)
        locks["locmem"].break_lock("lost:1")  # as an expiry during a long pause would
        return HttpResponse("ok")

    view = BaseHandler().make_view_atomic(guarded)
    with pytest.raises(LockLost):
        view(RequestFactory().post("/"), n=1)
    assert not Counter.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_database_backend_on_sqlite_answers_423_at_once_inside_the_transaction(
    atomic_requests: Callable[..., None],
) -> None:
    """It joins the request's transaction and cannot wait there, whatever the timeout (60)."""
    atomic_requests("default")
    counter = Counter.objects.create(value=0)
    with lock(f"counter:{counter.pk}", backend="db-sqlite"):
        response = Client().post(f"/function/db-sqlite/default/{counter.pk}/")
    assert response.status_code == 423
    assert Client().post(f"/function/db-sqlite/default/{counter.pk}/").status_code == 200
    assert Counter.objects.get(pk=counter.pk).value == 1
    assert locks["db-sqlite"].list(f"counter:{counter.pk}") == []  # released after the commit


@pytest.mark.django_db  # Django's TestCase: its transaction never commits
def test_in_a_test_case_the_view_releases_when_it_returns(
    atomic_requests: Callable[..., None],
) -> None:
    """A test's second request to a guarded view does not find the first's lock held."""
    atomic_requests("default")
    counter = Counter.objects.create(value=0)
    client = Client()
    url = f"/function/locmem/default/{counter.pk}/"
    assert [client.post(url).status_code for _ in range(3)] == [200, 200, 200]
    assert Counter.objects.get(pk=counter.pk).value == 3


@pytest.mark.django_db(transaction=True)
def test_async_views_do_not_run_under_atomic_requests(
    atomic_requests: Callable[..., None],
) -> None:
    """Django refuses an async view under ATOMIC_REQUESTS, unless it opts out."""
    import asyncio

    @lock_view("async:{n}", backend="locmem")
    async def guarded(request: HttpRequest, n: int) -> HttpResponse:
        return HttpResponse(str(request.dlock.token))  # type: ignore[attr-defined]

    atomic_requests("default")
    view = BaseHandler().make_view_atomic
    with pytest.raises(RuntimeError, match="ATOMIC_REQUESTS with async views"):
        view(guarded)
    opted_out = transaction.non_atomic_requests(guarded)
    assert view(opted_out) is opted_out
    response = asyncio.run(opted_out(RequestFactory().get("/"), n=1))
    assert int(response.content) > 0


# --- the view's lease: request.dlock ----------------------------------------------------


@pytest.fixture
def _fenced_gates() -> Iterator[None]:
    views_atomic.gate.clear()
    views_atomic.entered.clear()
    yield
    views_atomic.gate.set()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_fenced_gates")
def test_a_guarded_view_fences_its_save_with_request_dlock() -> None:
    """Issue 27: the view had no token. Now ``request.dlock`` is its lease.

    t0 request A holds doc:1, t1 its lease is broken (as an expiry would),
    t2 B takes the lock and writes with its newer token, t3 A resumes and
    saves: refused with StaleWrite (A answers 409), B's title stays.
    """
    doc = Document.objects.create(title="original")
    first = Client().get(f"/fenced/{doc.pk}/").content
    assert Document.objects.get(pk=doc.pk).fence == int(first)  # the view's own token

    a: list[Any] = []
    thread = threading.Thread(
        target=lambda: a.append(Client().get(f"/fenced/{doc.pk}/?wait=1&title=stale"))
    )
    thread.start()
    try:
        assert views_atomic.entered.wait(timeout=30)
        assert locks["locmem"].break_lock(f"doc:{doc.pk}")
        b = Client().get(f"/fenced/{doc.pk}/?title=newer")
        assert b.status_code == 200
    finally:
        views_atomic.gate.set()
        thread.join(timeout=30)
    assert a[0].status_code == 409
    assert "newer than" in a[0].content.decode()
    row = Document.objects.get(pk=doc.pk)
    assert (row.title, row.fence) == ("newer", int(b.content))


def test_a_class_based_view_finds_its_lease_on_self_request_and_in_current_lock() -> None:
    from django_dlock.views import current_lock

    first = Client().get("/lease/3/").content.decode().split()
    second = Client().get("/lease/3/").content.decode().split()
    assert first[0] == second[0] == "lease:3"
    assert int(second[1]) > int(first[1])
    assert current_lock() is None  # outside a guarded view


# --- the admin of a locked model ---------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_admin_refuses_a_save_whose_lock_is_held_with_a_message(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27: the admin answered 500 (LockTimeout) when the instance's lock was held."""
    monkeypatch.setattr(LockedDocument, "lock_timeout", 0)
    doc = LockedDocument.objects.create(title="original")
    change = f"/admin/tests/lockeddocument/{doc.pk}/change/"
    # Held by another thread: this thread's own lease would be reused (saves are reentrant).
    with held_by_another_thread(instance_lock_name(doc)):
        response = admin_client.post(change, {"title": "edited"})
        assert response.status_code == 200  # the form again, with what was typed
        text = response.content.decode()
        assert "Not saved: this object is being changed elsewhere" in text
        assert 'value="edited"' in text
        deleted = admin_client.post(
            f"/admin/tests/lockeddocument/{doc.pk}/delete/", {"post": "yes"}
        )
        assert deleted.status_code == 302
        assert "Not deleted" in admin_client.get(deleted["Location"]).content.decode()
    assert LockedDocument.objects.get(pk=doc.pk).title == "original"
    response = admin_client.post(change, {"title": "edited"})
    assert response.status_code == 302  # saved, back to the list
    assert LockedDocument.objects.get(pk=doc.pk).title == "edited"
