"""Fenced deletes, multi-table inheritance, and locked saves that reenter their own lock.

The databases: SQLite, PostgreSQL and MariaDB (``DATABASES``, as in
tests/test_fencing.py). The paused delete runs a real holder process that is
stopped with SIGSTOP past its lease, on each database lock backend with the
row in its own database, and on Redis with the row in SQLite.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.admin import AdminSite, ModelAdmin
from django.db import connections, models, transaction
from django.db.models.signals import post_save, pre_delete

from django_dlock import LockLost, LockTimeout, StaleWrite, fencing, lock, locks, rwlock, semaphore
from django_dlock.backends.base import BaseLockBackend
from django_dlock.fencing import FencedModel
from django_dlock.saves import instance_lock_name, locked_delete, locked_save
from tests.models import (
    ChildOfFenced,
    Document,
    DocumentNote,
    FencedChildOfPlain,
    FencedNote,
    FencedParent,
    FencedTag,
    LockedChildOfFenced,
    LockedDocument,
    LockedOrder,
    LockedPlace,
    LockedPlaceProxy,
    LockedRestaurant,
    LockedRestaurantProxy,
    PlainParent,
)
from tests.test_fencing import DATABASES, _held_elsewhere, held_by_another_thread

ROOT = Path(__file__).resolve().parent.parent
NEWER = 2**62  # a fence newer than any token a test's lock gets (locmem's are in µs)


def _with_notes(db: str, token: int, notes: int = 2) -> Document:
    doc = Document(title="doc")
    doc.save(fencing_token=token, using=db)
    for i in range(notes):
        DocumentNote.objects.using(db).create(document=doc, text=f"note {i}")
    return doc


def _rows(db: str, doc: Document) -> tuple[int, int]:
    return (
        Document.objects.using(db).filter(pk=doc.pk).count(),
        DocumentNote.objects.using(db).filter(document_id=doc.pk).count(),
    )


# --- fenced deletes -------------------------------------------------------------------------


@pytest.mark.parametrize("db", DATABASES)
def test_a_stale_fenced_delete_deletes_nothing_not_even_its_cascade(db: str) -> None:
    doc = _with_notes(db, token=5)
    stale = Document.objects.using(db).get(pk=doc.pk)
    newer = Document.objects.using(db).get(pk=doc.pk)
    newer.body = "by 7"
    newer.save(fencing_token=7, using=db)  # B, with a newer token
    with pytest.raises(StaleWrite, match="fencing token 7, newer than 6: this delete is refused"):
        stale.delete(fencing_token=6, using=db)
    assert _rows(db, doc) == (1, 2)
    assert Document.objects.using(db).get(pk=doc.pk).fence == 7
    with transaction.atomic(using=db):  # a refusal inside atomic() leaves it usable
        with pytest.raises(StaleWrite):
            stale.delete(fencing_token=6, using=db)
        Document(title="after").save(fencing_token=8, using=db)
    assert Document.objects.using(db).filter(title="after").exists()
    assert stale.delete(fencing_token=7, using=db)[0] == 3  # the same lease: deleted, cascade too
    assert _rows(db, doc) == (0, 0)


@pytest.mark.parametrize("db", DATABASES)
def test_a_fenced_delete_of_a_row_already_deleted_deletes_nothing_more(db: str) -> None:
    doc = _with_notes(db, token=5, notes=0)
    Document.objects.using(db).filter(pk=doc.pk).delete()
    assert doc.delete(fencing_token=9, using=db)[0] == 0


@pytest.mark.parametrize("db", DATABASES)
def test_fenced_delete_of_a_queryset_is_all_or_nothing(db: str) -> None:
    a, b = _with_notes(db, token=3), _with_notes(db, token=9)
    docs = Document.objects.using(db).filter(pk__in=[a.pk, b.pk])
    with pytest.raises(StaleWrite, match="newer than 5: this delete is refused"):
        fencing.fenced_delete(docs, 5)
    assert (_rows(db, a), _rows(db, b)) == ((1, 2), (1, 2))
    deleted, per_model = fencing.fenced_delete(docs, 9)
    assert (deleted, per_model) == (6, {"tests.Document": 2, "tests.DocumentNote": 4})
    assert (_rows(db, a), _rows(db, b)) == ((0, 0), (0, 0))
    with pytest.raises(TypeError, match="fencing_token must be an int"):
        fencing.fenced_delete(docs, "9")  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=True)
def test_locked_delete_and_the_mixins_delete_are_fenced_with_the_locks_token() -> None:
    """A newer token (another holder's) on the row: the locked delete is refused."""
    doc = _with_notes("default", token=0)
    Document.objects.filter(pk=doc.pk).update(fence=NEWER)  # a newer holder's write
    with pytest.raises(StaleWrite, match="this delete is refused"):
        locked_delete(doc, backend="locmem")
    assert _rows("default", doc) == (1, 2)
    locked = LockedDocument.objects.create(title="x")
    LockedDocument.objects.filter(pk=locked.pk).update(fence=NEWER)
    with pytest.raises(StaleWrite, match="this delete is refused"):
        locked.delete()
    assert LockedDocument.objects.filter(pk=locked.pk).exists()
    assert not _held_elsewhere(instance_lock_name(locked))  # released after the refusal
    LockedDocument.objects.filter(pk=locked.pk).update(fence=0)
    assert locked.delete() == (1, {"tests.LockedDocument": 1})


@pytest.mark.with_default_db
@pytest.mark.multiprocess
@pytest.mark.backends("db-sqlite", "db-postgresql", "db-mysql", "redis")
@pytest.mark.parametrize("mode", ["by_hand", "locked_delete", "mixin"])
def test_a_paused_holders_delete_is_refused_and_deletes_nothing(
    backend_alias: str, backend: BaseLockBackend, tmp_path: Path, mode: str
) -> None:
    """A takes the lock, pauses past its lease; B takes it, writes; A resumes and deletes."""
    db = settings.CONFORMANCE_BACKENDS[backend_alias] or "default"
    if mode == "mixin":
        target: models.Model = LockedDocument.objects.using(db).create(title="pause")
        notes = 0
    else:
        target = _with_notes(db, token=0)
        notes = 2
    name = instance_lock_name(target)
    ttl = max(0.5, backend.min_ttl)
    aliases = {"default", db, *backend.options.values()} & set(connections)
    config = {
        "databases": {a: dict(connections[a].settings_dict) for a in aliases},
        "backend": settings.DLOCK_BACKENDS[backend_alias],
        "database": db,
        "name": name,
        "ttl": ttl,
        "pk": target.pk,
        "mode": mode,
        "go": str(tmp_path / "go"),
    }
    env = {**os.environ, "DLOCK_PAUSE_CONFIG": json.dumps(config, default=str)}
    a = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "pause_delete_worker.py")],
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert a.stdout is not None
    try:
        a_token = json.loads(a.stdout.readline())["token"]
        os.kill(a.pid, signal.SIGSTOP)  # A pauses holding the lock, its watchdog too
        time.sleep(ttl * 2 + backend.expiry_slack + 0.5)  # past its lease
        with lock(name, backend=backend_alias, timeout=30) as b:
            assert b.token > a_token
            type(target).objects.using(db).filter(pk=target.pk).update(fence=b.token)
            target.save(fencing_token=b.token, using=db)  # type: ignore[call-arg]
            (tmp_path / "go").touch()
            os.kill(a.pid, signal.SIGCONT)
            outcome = json.loads(a.stdout.readline())
        assert a.wait(timeout=30) == 0
    finally:
        a.kill()
    assert outcome["delete"].startswith("StaleWrite: "), outcome
    assert f"newer than {a_token}" in outcome["delete"]
    row = type(target).objects.using(db).get(pk=target.pk)
    assert row.fence == b.token  # type: ignore[attr-defined]
    assert DocumentNote.objects.using(db).filter(document_id=target.pk).count() == (
        notes if mode != "mixin" else 0
    )


# --- multi-table inheritance ----------------------------------------------------------------


@pytest.mark.parametrize("db", DATABASES)
@pytest.mark.parametrize(
    "model", [ChildOfFenced, FencedChildOfPlain], ids=["fenced-parent", "fenced-child"]
)
def test_fenced_saves_and_deletes_with_multi_table_inheritance(
    db: str, model: type[FencedModel]
) -> None:
    parent = FencedParent if model is ChildOfFenced else PlainParent
    obj = model(title="t", extra="e")  # type: ignore[misc]
    obj.save(fencing_token=3, using=db)
    newer = model.objects.using(db).get(pk=obj.pk)
    newer.title, newer.extra = "by 5", "by 5"  # type: ignore[attr-defined]
    newer.save(fencing_token=5, using=db)
    newer.save(fencing_token=5, using=db, update_fields=["title"])  # the parent's column only

    stale = model.objects.using(db).get(pk=obj.pk)
    stale.title, stale.extra = "by 4", "by 4"  # type: ignore[attr-defined]
    with pytest.raises(StaleWrite, match="fencing token 5, newer than 4"):
        stale.save(fencing_token=4, using=db)
    with transaction.atomic(using=db):
        with pytest.raises(StaleWrite):
            stale.save(fencing_token=4, using=db, update_fields=["title"])
    row = model.objects.using(db).get(pk=obj.pk)
    assert (row.title, row.extra, row.fence) == ("by 5", "by 5", 5)  # type: ignore[attr-defined]
    assert parent.objects.using(db).get(pk=obj.pk).title == "by 5"  # type: ignore[attr-defined]

    with pytest.raises(StaleWrite, match="this delete is refused"):
        stale.delete(fencing_token=4, using=db)
    assert model.objects.using(db).filter(pk=obj.pk).exists()
    stale.delete(fencing_token=6, using=db)
    assert not parent.objects.using(db).filter(pk=obj.pk).exists()
    with pytest.raises(StaleWrite, match="deleted after it was loaded"):
        stale.save(fencing_token=7, using=db)  # neither table gets the row back
    assert not parent.objects.using(db).filter(pk=obj.pk).exists()


@pytest.mark.parametrize("db", DATABASES)
def test_a_locked_save_of_a_child_of_a_fenced_model(db: str) -> None:
    obj = LockedChildOfFenced(title="t")
    obj.save(using=db)
    obj.note = "edited"
    obj.save(using=db)
    fence = LockedChildOfFenced.objects.using(db).get(pk=obj.pk).fence
    assert fence > 0
    FencedParent.objects.using(db).filter(pk=obj.pk).update(fence=fence + NEWER)
    with pytest.raises(StaleWrite):
        obj.save(using=db)
    with pytest.raises(StaleWrite):
        obj.delete(using=db)
    assert LockedChildOfFenced.objects.using(db).get(pk=obj.pk).note == "edited"


# --- a save inside a save of the same instance ----------------------------------------------

REENTRANT = pytest.mark.backends(
    "locmem", "db-sqlite", "db-postgresql", "db-mysql", "redis", "etcd"
)


@pytest.mark.with_default_db
@REENTRANT
def test_two_saves_in_one_atomic_with_release_on_commit(backend_alias: str) -> None:
    """The docs' Order: the first save holds the lock until commit, the second uses it."""
    order = LockedOrder.objects.create()
    order.lock_backend, order.lock_timeout = backend_alias, 0
    name = instance_lock_name(order)
    with transaction.atomic():
        order.status = "paid"
        order.save()
        order.total = 10
        order.save()  # waited for itself until LockTimeout
        again = LockedOrder.objects.get(pk=order.pk)  # another instance of the same row
        again.lock_backend, again.lock_timeout = backend_alias, 0
        again.save()
        if backend_alias != "db-sqlite":  # its attempt would wait for this transaction's commit
            assert _held_elsewhere_on(name, backend_alias)
    assert not _held_elsewhere_on(name, backend_alias)
    row = LockedOrder.objects.get(pk=order.pk)
    assert (row.status, row.total) == ("paid", 10)
    first = row.fence
    order.lock_timeout = 10  # a database backend releases on its renewal thread
    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic():
            order.save()
            raise RuntimeError("roll back the savepoint, and its lease")
        order.save()  # a new lease, not the one the savepoint let go
    assert LockedOrder.objects.get(pk=order.pk).fence > first


@pytest.mark.with_default_db
@REENTRANT
def test_a_post_save_receiver_that_saves_again(backend_alias: str) -> None:
    order = LockedOrder.objects.create()
    order.lock_backend, order.lock_timeout = backend_alias, 0
    tokens: list[int] = []

    def total_after_save(sender: Any, instance: LockedOrder, **kwargs: Any) -> None:
        tokens.append(instance.fence)
        if instance.total == 0:
            instance.total = 99
            instance.save(update_fields=["total"])

    post_save.connect(total_after_save, LockedOrder)
    try:
        order.save()
    finally:
        post_save.disconnect(total_after_save, LockedOrder)
    assert len(tokens) == 2 and tokens[0] == tokens[1]  # one lease, one token
    row = LockedOrder.objects.get(pk=order.pk)
    assert (row.total, row.fence) == (99, tokens[0])
    assert not _held_elsewhere_on(instance_lock_name(order), backend_alias)


@pytest.mark.with_default_db
@REENTRANT
def test_a_save_and_a_delete_inside_with_lock_of_the_instance(backend_alias: str) -> None:
    order = LockedOrder.objects.create()
    order.lock_backend, order.lock_timeout = backend_alias, 0
    name = instance_lock_name(order)
    with lock(name, backend=backend_alias, timeout=10) as held:
        order.total = 5
        order.save()
        assert LockedOrder.objects.get(pk=order.pk).fence == held.token
        assert locked_save(order, backend=backend_alias, timeout=0) is held
        assert _held_elsewhere_on(name, backend_alias)  # still held, by the with block
        order.delete()
    assert not LockedOrder.objects.filter(pk=order.pk).exists()
    assert not _held_elsewhere_on(name, backend_alias)


@pytest.mark.django_db(transaction=True)
def test_a_save_inside_a_decorated_call_a_guarded_view_or_a_task_of_its_name() -> None:
    """Issue 27 review: only ``with lock(...)`` was seen; these waited for themselves."""
    from django.test import RequestFactory

    from django_dlock.celery import locked_task
    from django_dlock.views import lock_view

    order = LockedOrder.objects.create()
    order.lock_timeout = 0
    name = instance_lock_name(order)
    seen: list[tuple[str, int, int]] = []

    def save_under(how: str, token: int) -> None:
        order.total += 1
        order.save()
        seen.append((how, token, LockedOrder.objects.get(pk=order.pk).fence))

    @lock(name, backend="locmem", timeout=0)
    def decorated() -> None:
        save_under("decorated", _held_elsewhere_holder_token(name))

    @lock_view(name, backend="locmem")
    def view(request: Any) -> Any:
        from django.http import HttpResponse

        save_under("view", request.dlock.token)
        return HttpResponse("ok")

    @locked_task(key=name, backend="locmem", on_locked="raise", name="tests.reentrant_save")
    def task() -> None:
        save_under("task", _held_elsewhere_holder_token(name))

    decorated()
    assert view(RequestFactory().post("/")).status_code == 200
    task.apply().get()
    assert [how for how, _, _ in seen] == ["decorated", "view", "task"]
    assert all(token == fence for _, token, fence in seen)  # each saved under the outer lease
    assert LockedOrder.objects.get(pk=order.pk).total == 3
    assert not _held_elsewhere(name)


def _held_elsewhere_holder_token(name: str) -> int:
    from django_dlock import locks

    [info] = locks["locmem"].list(name)
    return info.token


@pytest.mark.django_db(transaction=True)
def test_another_threads_lease_and_another_backends_are_not_reused() -> None:
    order = LockedOrder.objects.create()
    order.lock_timeout = 0
    name = instance_lock_name(order)
    with held_by_another_thread(name), pytest.raises(LockTimeout):
        order.save()
    with lock(name, backend="db-sqlite", timeout=10) as other_backend:
        order.save()  # locmem's lock, not db-sqlite's
        assert LockedOrder.objects.get(pk=order.pk).fence != other_backend.token
    with lock(name, backend="locmem", timeout=10) as held:
        pass
    order.save()  # a released lease is not reused
    assert LockedOrder.objects.get(pk=order.pk).fence > held.token


def _held_elsewhere_on(name: str, backend: str) -> bool:
    """Whether another thread would find ``name`` held on ``backend``."""
    result: list[bool] = []

    def attempt() -> None:
        try:
            with lock(name, backend=backend, timeout=0):
                result.append(False)
        except LockTimeout:
            result.append(True)
        except BaseException as e:
            result.append(e)  # type: ignore[arg-type]
        finally:
            connections.close_all()

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(timeout=30)
    assert isinstance(result[0], bool), result[0]
    return result[0]


# --- stale instances, querysets and the admin's bulk delete ----------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_stale_instance_passes_the_fence_of_a_locked_save() -> None:
    """Each locked save takes a newer token, so a value read before the lock is written back."""
    order = LockedOrder.objects.create(total=1)
    stale = LockedOrder.objects.get(pk=order.pk)  # read outside the lock
    order.total = 2
    order.save()
    stale.save()  # not refused: its token is newer than order's
    assert LockedOrder.objects.get(pk=order.pk).total == 1  # order's write is lost


@pytest.mark.parametrize("db", DATABASES)
def test_read_under_the_lock_then_save_loses_no_increment(db: str) -> None:
    """The fix for stale instances: refresh_from_db() under the instance's lock, then save()."""
    order = LockedOrder.objects.using(db).create()
    errors: list[BaseException] = []

    def increment(times: int) -> None:
        mine = LockedOrder.objects.using(db).get(pk=order.pk)  # stale by the time it saves
        try:
            for _ in range(times):
                with lock(instance_lock_name(mine), backend="locmem", timeout=30):
                    mine.refresh_from_db()
                    mine.total += 1
                    mine.save()  # uses the lease of the with block
        except BaseException as e:
            errors.append(e)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=increment, args=(20,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert LockedOrder.objects.using(db).get(pk=order.pk).total == 80


@pytest.mark.django_db(transaction=True)
def test_queryset_update_delete_and_the_admins_bulk_delete_bypass_the_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As docs/fencing.md says; and its delete_queryset override takes each lock."""
    monkeypatch.setattr(LockedDocument, "lock_timeout", 0)
    kept = LockedDocument.objects.create(title="a")
    gone = LockedDocument.objects.create(title="b")
    LockedDocument.objects.filter(pk=kept.pk).update(fence=NEWER)  # a newer holder's write
    with held_by_another_thread(instance_lock_name(kept)):
        assert LockedDocument.objects.filter(pk=kept.pk).update(title="bypassed") == 1
        assert LockedDocument.objects.get(pk=kept.pk).title == "bypassed"  # no lock, no fence
        kept.title = "bulk"
        assert LockedDocument.objects.bulk_update([kept], ["title"]) == 1
        admin = LockedPerObjectAdmin(LockedDocument, AdminSite())
        with pytest.raises(LockTimeout):
            admin.delete_queryset(None, LockedDocument.objects.all())
        assert LockedDocument.objects.count() == 2  # all or nothing: it ran in atomic()
        ModelAdmin(LockedDocument, AdminSite()).delete_queryset(
            None, LockedDocument.objects.filter(pk=kept.pk)
        )  # Django's own: a bare QuerySet.delete()
    assert list(LockedDocument.objects.values_list("pk", flat=True)) == [gone.pk]
    LockedPerObjectAdmin(LockedDocument, AdminSite()).delete_queryset(
        None, LockedDocument.objects.all()
    )
    assert not LockedDocument.objects.exists()


class LockedPerObjectAdmin(ModelAdmin):  # type: ignore[type-arg]
    """The docs' pattern: the admin's bulk delete, one locked, fenced delete per object."""

    def delete_queryset(self, request: Any, queryset: Any) -> None:
        with transaction.atomic(using=queryset.db):
            for obj in queryset:
                obj.delete()


# --- review of issue 27: which lease a save reuses, one lock per row, fenced cascades --------


@contextlib.contextmanager
def _mutex_held_elsewhere(name: str, backend: str) -> Iterator[int]:
    """Hold the mutex ``name`` on ``backend`` in another thread for the block; its token."""
    acquired: queue.Queue[int | BaseException] = queue.Queue()
    leave = threading.Event()

    def hold() -> None:
        try:
            with lock(name, backend=backend, timeout=30) as held:
                acquired.put(held.token)
                leave.wait(timeout=60)
        except BaseException as e:
            acquired.put(e)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        token = acquired.get(timeout=60)
        if isinstance(token, BaseException):
            raise token
        yield token
    finally:
        leave.set()
        thread.join(timeout=30)


@pytest.mark.with_default_db
@REENTRANT
@pytest.mark.parametrize("kind", ["semaphore", "read", "write", "view"])
def test_a_slot_or_a_read_write_lease_of_the_name_is_not_the_instances_lock(
    backend_alias: str, kind: str
) -> None:
    """Review of issue 27, item 3: a save reused a slot of the instance's name as its mutex."""
    from django.http import HttpResponse
    from django.test import RequestFactory

    from django_dlock.views import lock_view

    order = LockedOrder.objects.create(total=1)
    order.lock_backend, order.lock_timeout = backend_alias, 0
    name = instance_lock_name(order)
    refused: list[str] = []

    def save_and_delete() -> None:
        order.total = 2
        with pytest.raises(LockTimeout):
            order.save()  # wrote while another thread held the mutex
        with pytest.raises(LockTimeout):
            order.delete()
        refused.append(kind)

    with _mutex_held_elsewhere(name, backend_alias):
        if kind == "view":

            @lock_view(name, backend=backend_alias, limit=3)
            def view(request: Any) -> Any:
                save_and_delete()
                return HttpResponse("ok")

            assert view(RequestFactory().post("/")).status_code == 200
        else:
            side = {
                "semaphore": semaphore(name, limit=3, backend=backend_alias, timeout=10),
                "read": rwlock(name, backend=backend_alias, timeout=10).read(),
                "write": rwlock(name, backend=backend_alias, timeout=10).write(),
            }[kind]
            with side:
                save_and_delete()
    assert refused == [kind]
    row = LockedOrder.objects.get(pk=order.pk)
    assert row.total == 1
    with semaphore(name, limit=3, backend=backend_alias, timeout=10):
        order.save()  # takes the mutex (free now) and releases it
    assert LockedOrder.objects.get(pk=order.pk).total == 2
    assert not _held_elsewhere_on(name, backend_alias)


@pytest.mark.with_default_db
@REENTRANT
@pytest.mark.parametrize("how", ["broken", "expired"])
def test_a_save_does_not_reuse_a_lost_lease(
    backend_alias: str, backend: BaseLockBackend, how: str
) -> None:
    """Review of issue 27, item 4: a save inside the block wrote under a lease gone by then."""
    order = LockedOrder.objects.create(total=1)
    order.lock_backend, order.lock_timeout = backend_alias, 0
    name = instance_lock_name(order)
    ttl = max(0.5, backend.min_ttl)
    with pytest.raises(LockLost):  # leaving the block: its lease was lost
        with lock(name, backend=backend_alias, ttl=ttl, renew=False, timeout=10) as held:
            if how == "broken":
                assert locks[backend_alias].break_lock(name, token=held.token)
            else:
                time.sleep(ttl + backend.expiry_slack + 0.2)  # the lease runs out, unrenewed
            with _mutex_held_elsewhere(name, backend_alias) as other:
                assert other > held.token
                order.total = 99
                with pytest.raises(LockLost):
                    order.save()  # wrote while the other thread held the lock
                with pytest.raises(LockLost):
                    order.delete()
                with pytest.raises(LockLost):
                    locked_save(order, backend=backend_alias, timeout=0)
                row = LockedOrder.objects.get(pk=order.pk)
                assert (row.total, row.fence) == (1, 0)
    order.save()  # a new lease
    assert LockedOrder.objects.get(pk=order.pk).total == 99


@pytest.mark.parametrize("db", DATABASES)
def test_a_parent_its_child_and_their_proxies_take_the_rows_one_lock(db: str) -> None:
    """Review of issue 27, item 6: ``tests.lockedplace:1`` and ``tests.lockedrestaurant:1``."""
    restaurant = LockedRestaurant.objects.using(db).create(menu="m")
    pk = restaurant.pk
    views = [
        restaurant,
        LockedPlace.objects.using(db).get(pk=pk),
        LockedPlaceProxy.objects.using(db).get(pk=pk),
        LockedRestaurantProxy.objects.using(db).get(pk=pk),
    ]
    assert {instance_lock_name(obj) for obj in views} == {f"tests.lockedplace:{pk}"}
    assert instance_lock_name(restaurant, "{model_name}") == "lockedplace"
    with _mutex_held_elsewhere(instance_lock_name(views[1]), "locmem"):
        for obj in views:
            obj.lock_timeout = 0  # type: ignore[attr-defined]
            obj.visits = 5  # type: ignore[attr-defined]
            with pytest.raises(LockTimeout):
                obj.save(using=db)  # took another lock and wrote the same row
            with pytest.raises(LockTimeout):
                obj.delete(using=db)
    assert LockedPlace.objects.using(db).get(pk=pk).visits == 0

    # The docs' read-modify-write under the instance's lock, from either side.
    for obj in views:
        with lock(instance_lock_name(obj), backend="locmem", timeout=10) as held:
            obj.refresh_from_db()
            obj.visits += 1  # type: ignore[attr-defined]
            obj.save(using=db)  # the block's lease, fenced with its token
        assert LockedPlace.objects.using(db).get(pk=pk).fence == held.token
    assert LockedRestaurant.objects.using(db).get(pk=pk).visits == 4


@pytest.mark.parametrize("db", DATABASES)
@pytest.mark.parametrize("how", ["instance", "queryset"])
@pytest.mark.parametrize("collected", [False, True], ids=["fast-delete", "loaded"])
def test_a_stale_fenced_delete_does_not_cascade_over_a_newer_holders_rows(
    db: str, how: str, collected: bool
) -> None:
    """Review of issue 27, item 8: only the deleted row's fence was checked, not its cascade's."""
    doc = Document(title="order")
    doc.save(fencing_token=5, using=db)
    note = FencedNote(document=doc, text="by 5")
    note.save(fencing_token=5, using=db)
    tag = FencedTag(document=doc)
    tag.save(fencing_token=5, using=db)
    note.text = "by 7"
    note.save(fencing_token=7, using=db)  # B, a newer holder, wrote the note only

    def delete(token: int) -> tuple[int, dict[str, int]]:
        if how == "instance":
            stale = Document.objects.using(db).get(pk=doc.pk)
            return stale.delete(fencing_token=token, using=db)  # type: ignore[no-any-return]
        return fencing.fenced_delete(Document.objects.using(db).filter(pk=doc.pk), token)

    def loaded(**kwargs: Any) -> None:
        """A pre_delete receiver: Django loads the rows instead of a bare DELETE."""

    if collected:
        pre_delete.connect(loaded, sender=FencedNote)
        pre_delete.connect(loaded, sender=FencedTag)
    try:
        with pytest.raises(
            StaleWrite,
            match=rf"tests.FencedNote {note.pk}, which the delete cascades to, was written "
            r"with fencing token 7, newer than 6: this delete is refused",
        ):
            delete(6)
        with transaction.atomic(using=db):  # inside atomic(): refused, and still usable
            with pytest.raises(StaleWrite):
                delete(6)
            Document(title="after").save(fencing_token=8, using=db)
        assert Document.objects.using(db).get(pk=doc.pk).fence == 5
        assert FencedNote.objects.using(db).get(pk=note.pk).text == "by 7"
        assert FencedTag.objects.using(db).get(pk=tag.pk).document_id == doc.pk

        FencedTag.objects.using(db).filter(pk=tag.pk).update(fence=9)  # a newer write
        with pytest.raises(StaleWrite, match=rf"tests.FencedTag {tag.pk}, which the delete"):
            delete(8)  # its SET_NULL would have written the tag
        assert FencedTag.objects.using(db).get(pk=tag.pk).document_id == doc.pk
        assert FencedNote.objects.using(db).filter(pk=note.pk).exists()

        assert delete(9) == (2, {"tests.Document": 1, "tests.FencedNote": 1})
    finally:
        pre_delete.disconnect(loaded, sender=FencedNote)
        pre_delete.disconnect(loaded, sender=FencedTag)
    row = FencedTag.objects.using(db).get(pk=tag.pk)
    assert (row.document_id, row.fence) == (None, 9)
