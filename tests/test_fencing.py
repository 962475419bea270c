"""Fenced saves on every database, the pause scenario on every backend, locked saves."""

from __future__ import annotations

import contextlib
import inspect
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

import django
import pytest
from django.conf import settings
from django.db import connections, models, transaction
from django.db.models.signals import post_save

from django_dlock import LockTimeout, StaleWrite, lock
from django_dlock.backends.base import BaseLockBackend
from django_dlock.fencing import FencedModel, fenced_update
from django_dlock.saves import instance_lock_name, locked_delete, locked_save
from tests.models import Document, LockedDocument, LockedNote

ROOT = Path(__file__).resolve().parent.parent

DATABASES = [
    pytest.param(
        alias,
        marks=[
            pytest.mark.django_db(transaction=True, databases=[alias]),
            *(
                [pytest.mark.skip(reason=settings.UNAVAILABLE_BACKENDS[backend])]
                if backend in settings.UNAVAILABLE_BACKENDS
                else []
            ),
        ],
        id=alias,
    )
    for alias, backend in [
        ("default", "db-sqlite"),
        ("postgresql", "db-postgresql"),
        ("mysql", "db-mysql"),
    ]
]


# --- fenced saves, on SQLite, PostgreSQL and MariaDB ----------------------------------------


@pytest.mark.parametrize("db", DATABASES)
def test_a_fenced_save_refuses_an_older_token_and_leaves_the_row(db: str) -> None:
    doc = Document(title="report")
    doc.save(fencing_token=10, using=db)
    assert Document.objects.using(db).get(pk=doc.pk).fence == 10

    saved: list[int] = []

    def on_save(sender: Any, instance: Document, **kwargs: Any) -> None:
        saved.append(instance.fence)

    post_save.connect(on_save, Document)
    newer = Document.objects.using(db).get(pk=doc.pk)
    newer.body = "by 12"
    try:
        newer.save(fencing_token=12, using=db)
    finally:
        post_save.disconnect(on_save, Document)
    assert saved == [12]  # Django's own save path: its signals are sent
    newer.body = "by 12, again"
    newer.save(fencing_token=12, using=db)  # the same lease writing twice

    stale = Document.objects.using(db).get(pk=doc.pk)
    stale.fence = 0  # what A read before it paused
    stale.body = "by 11"
    with pytest.raises(StaleWrite, match="fencing token 12, newer than 11"):
        stale.save(fencing_token=11, using=db)
    assert stale.fence == 0  # the instance is as it was
    with pytest.raises(StaleWrite):
        stale.save(fencing_token=11, using=db, update_fields=["body"])
    row = Document.objects.using(db).get(pk=doc.pk)
    assert (row.body, row.fence) == ("by 12, again", 12)

    row.title = "unfenced"
    row.save(using=db)  # no token: an ordinary save, the fence kept
    assert Document.objects.using(db).get(pk=doc.pk).fence == 12


@pytest.mark.parametrize("db", DATABASES)
def test_a_refused_save_leaves_the_transaction_usable(db: str) -> None:
    doc = Document(title="t")
    doc.save(fencing_token=5, using=db)
    with transaction.atomic(using=db):
        stale = Document.objects.using(db).get(pk=doc.pk)
        with pytest.raises(StaleWrite):
            stale.save(fencing_token=4, using=db)
        Document(title="after").save(fencing_token=6, using=db)
    assert Document.objects.using(db).filter(title="after").exists()


@pytest.mark.parametrize("db", DATABASES)
def test_fenced_update_is_all_or_nothing(db: str) -> None:
    a, b = Document(title="a"), Document(title="b")
    a.save(fencing_token=3, using=db)
    b.save(fencing_token=9, using=db)
    docs = Document.objects.using(db).filter(pk__in=[a.pk, b.pk])
    with pytest.raises(StaleWrite, match="newer than 5"):
        fenced_update(docs, 5, body="by 5")
    assert sorted(docs.values_list("body", "fence")) == [("", 3), ("", 9)]
    assert fenced_update(docs, 9, body="by 9") == 2
    assert sorted(docs.values_list("body", "fence")) == [("by 9", 9), ("by 9", 9)]


@pytest.mark.parametrize("db", DATABASES)
def test_a_stale_fenced_save_does_not_bring_back_a_deleted_row(db: str) -> None:
    """t0 A loads the row, t1 A pauses, t2 B (newer token) deletes it, t3 A saves fenced."""
    doc = Document(title="gone")
    doc.save(fencing_token=20, using=db)
    stale = Document.objects.using(db).get(pk=doc.pk)
    Document.objects.using(db).filter(pk=doc.pk).delete()  # B's delete
    stale.body = "by 20, after the delete"
    with pytest.raises(StaleWrite, match="deleted after it was loaded"):
        stale.save(fencing_token=20, using=db)
    with pytest.raises(StaleWrite, match="deleted after it was loaded"):
        stale.save(fencing_token=21, using=db, update_fields=["body"])
    assert not Document.objects.using(db).filter(pk=doc.pk).exists()
    stale.save(fencing_token=22, using=db, force_insert=True)  # a re-create on purpose
    assert Document.objects.using(db).get(pk=doc.pk).fence == 22
    fresh = Document(pk=doc.pk + 1000, title="new, with its own pk")
    fresh.save(fencing_token=23, using=db)  # a new instance is still inserted
    assert Document.objects.using(db).get(pk=fresh.pk).fence == 23


@pytest.mark.django_db(transaction=True)
def test_a_stale_locked_save_does_not_undo_a_newer_locked_delete() -> None:
    doc = Document(title="x")
    doc.save()
    stale = Document.objects.get(pk=doc.pk)
    older = lock(instance_lock_name(doc), backend="db-sqlite").acquire()
    older.release()  # A's lease ended (in the story: it expired while A paused)
    locked_delete(doc, backend="db-sqlite")  # B, with a newer token
    with pytest.raises(StaleWrite):
        stale.save(fencing_token=older.token)
    assert not Document.objects.filter(pk=doc.pk).exists()


@pytest.mark.parametrize("token", ["7", 7.5, True])
def test_the_token_must_be_an_int(token: Any) -> None:
    with pytest.raises(TypeError, match="fencing_token must be an int"):
        Document(title="x").save(fencing_token=token)
    with pytest.raises(TypeError, match="fencing_token must be an int"):
        fenced_update(Document.objects.none(), token)


# --- the pause scenario, on every backend ---------------------------------------------------


@pytest.mark.with_default_db
@pytest.mark.multiprocess
def test_a_paused_holders_write_is_refused(
    backend_alias: str, backend: BaseLockBackend, name: str, tmp_path: Path
) -> None:
    """etcd's contrib/lock scenario: A pauses past its lease, B writes, A resumes and writes."""
    if not backend.supports_multiprocess:
        pytest.skip(f"{type(backend).__name__} keeps its locks in one process's memory")
    db = settings.CONFORMANCE_BACKENDS[backend_alias] or "default"
    doc = Document(title="pause", body="initial")
    doc.save(using=db)
    ttl = max(0.5, backend.min_ttl)
    aliases = {"default", db, *backend.options.values()} & set(connections)
    config = {
        "databases": {a: dict(connections[a].settings_dict) for a in aliases},
        "backend": settings.DLOCK_BACKENDS[backend_alias],
        "database": db,
        "name": name,
        "ttl": ttl,
        "pk": doc.pk,
        "go": str(tmp_path / "go"),
    }
    env = {**os.environ, "DLOCK_PAUSE_CONFIG": json.dumps(config, default=str)}
    a = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "pause_worker.py")],
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
            doc.body = "written by B"
            doc.save(fencing_token=b.token, using=db)
            (tmp_path / "go").touch()
            os.kill(a.pid, signal.SIGCONT)
            outcome = json.loads(a.stdout.readline())
        assert a.wait(timeout=30) == 0
    finally:
        a.kill()
    assert outcome["save"].startswith("StaleWrite: ")
    assert outcome["ensure"].startswith("LockLost: ")
    row = Document.objects.using(db).get(pk=doc.pk)
    assert (row.body, row.fence) == ("written by B", b.token)


# --- locked saves ---------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_locked_save_takes_the_lock_and_fences_with_its_token() -> None:
    doc = Document(title="x")
    doc.save()
    held = locked_save(doc, backend="locmem")
    assert held.released
    assert Document.objects.get(pk=doc.pk).fence == held.token
    assert instance_lock_name(doc) == f"tests.document:{doc.pk}"
    with held_by_another_thread(instance_lock_name(doc)):
        with pytest.raises(LockTimeout):
            locked_save(doc, backend="locmem", timeout=0)
    locked_delete(doc, backend="locmem")
    assert not Document.objects.filter(pk=doc.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_the_mixin_locks_save_and_delete() -> None:
    doc = LockedDocument(title="new")
    doc.save()  # no pk yet: saved without the lock
    doc.title = "edited"
    doc.save()
    first = LockedDocument.objects.get(pk=doc.pk).fence
    assert first > 0  # fenced with the lock's token
    doc.save()
    assert LockedDocument.objects.get(pk=doc.pk).fence > first
    doc.lock_timeout = 0
    with held_by_another_thread(instance_lock_name(doc)):
        with pytest.raises(LockTimeout):
            doc.save()
        with pytest.raises(LockTimeout):
            doc.delete()
    assert locked_save(doc, backend="locmem").token > first  # no second lock taken
    doc.delete()
    assert not LockedDocument.objects.filter(pk=doc.pk).exists()
    other = LockedDocument.objects.create(title="other")
    locked_delete(other, backend="locmem", timeout=0)  # not the mixin's lock a second time
    assert not LockedDocument.objects.filter(pk=other.pk).exists()


@contextlib.contextmanager
def held_by_another_thread(name: str, backend: str = "locmem") -> Iterator[int]:
    """Hold ``name`` in another thread for the block; yields that lease's token."""
    acquired: queue.Queue[int | BaseException] = queue.Queue()
    leave = threading.Event()

    def hold() -> None:
        try:
            with lock(name, backend=backend, timeout=10) as held:
                acquired.put(held.token)
                leave.wait(timeout=60)
        except BaseException as e:
            acquired.put(e)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        token = acquired.get(timeout=30)
        if isinstance(token, BaseException):
            raise token
        yield token
    finally:
        leave.set()
        thread.join(timeout=30)


def _held_elsewhere(name: str) -> bool:
    """Whether another thread would find ``name`` held on the locmem backend."""
    result: list[bool] = []

    def attempt() -> None:
        try:
            with lock(name, backend="locmem", timeout=0):
                result.append(False)
        except LockTimeout:
            result.append(True)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join()
    return result[0]


@pytest.mark.django_db(transaction=True)
def test_release_on_commit_holds_the_lock_until_the_transaction_commits() -> None:
    note = LockedNote.objects.create(text="a")
    name = instance_lock_name(note)
    with transaction.atomic():
        note.text = "b"
        note.save()
        assert _held_elsewhere(name)  # nobody reads "b" before it is committed
    assert not _held_elsewhere(name)
    assert LockedNote.objects.get(pk=note.pk).text == "b"


@pytest.mark.django_db(transaction=True)
def test_release_on_commit_releases_on_rollback_and_savepoint_rollback() -> None:
    note = LockedNote.objects.create(text="a")
    name = instance_lock_name(note)
    with pytest.raises(RuntimeError), transaction.atomic():
        note.save()
        assert _held_elsewhere(name)
        raise RuntimeError("roll back")
    assert not _held_elsewhere(name)
    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic():
            note.save()
            raise RuntimeError("roll back the savepoint")
        assert not _held_elsewhere(name)
        note.save()
        assert _held_elsewhere(name)
    assert not _held_elsewhere(name)


def test_lock_names_need_a_primary_key() -> None:
    with pytest.raises(ValueError, match="before it has a primary key"):
        instance_lock_name(Document(title="x"))
    assert instance_lock_name(Document(pk=3, title="x"), "doc:{title}:{pk}") == "doc:x:3"


def test_the_do_update_that_fenced_model_overrides_has_the_pinned_signature() -> None:
    """FencedModel._do_update relies on Model._do_update's parameters (fencing.py).

    Django 4.2 to 5.2 take six and return a bool; 6.0 added ``returning_fields``
    and returns a list. A Django that changes them again fails here first.
    """
    expected = ["self", "base_qs", "using", "pk_val", "values", "update_fields", "forced_update"]
    if django.VERSION >= (6, 0):
        expected.append("returning_fields")
    parameters = inspect.signature(models.Model._do_update).parameters
    assert list(parameters) == expected, django.get_version()
    assert {p.kind for p in parameters.values()} == {inspect.Parameter.POSITIONAL_OR_KEYWORD}
    override = list(inspect.signature(FencedModel._do_update).parameters)
    assert override == [*expected[:7], "args", "kwargs"]
