"""SQLite under contention: waiting for a lock never fails the holder's transaction (issue 27)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import django
import pytest
from django.db import OperationalError, connections, transaction

from django_dlock import lock, rwlock, semaphore
from tests.models import Counter

KINDS: dict[str, Callable[[str], AbstractContextManager[Any]]] = {
    "mutex": lambda name: lock(name, backend="db-sqlite", timeout=60),
    "semaphore": lambda name: semaphore(name, limit=1, backend="db-sqlite", timeout=60),
    "rwlock": lambda name: rwlock(name, backend="db-sqlite", timeout=60).write(),
}


def _immediate_connection() -> Any:
    """The default database, with ``OPTIONS["transaction_mode"] = "IMMEDIATE"`` (Django 5.1+)."""
    default = connections["default"]
    options = {**default.settings_dict["OPTIONS"], "transaction_mode": "IMMEDIATE"}
    return type(default)({**default.settings_dict, "OPTIONS": options}, "default")


@pytest.mark.parametrize(
    ("kind", "mode"),
    [
        ("mutex", "deferred"),
        ("mutex", "IMMEDIATE"),
        ("semaphore", "IMMEDIATE"),
        ("rwlock", "IMMEDIATE"),
    ],
)
@pytest.mark.django_db(transaction=True)
def test_sqlite_waiters_never_fail_the_holders_transaction(
    kind: str, mode: str, name: str
) -> None:
    """``with lock(k): with atomic(): read, add one, write`` from 4 threads, 15 times each.

    Issue 27: the waiters' polling statement was a write. t0 the holder's
    transaction reads (SQLite's shared lock), t1 a waiter's acquire
    statement takes the write lock, t2 the holder's write cannot upgrade its
    lock and fails with "database is locked" (13-30 % of transactions).
    A mutex's waiters now only read while the lease is live, with Django's
    default (deferred) transactions. Semaphore and rwlock waiters record
    themselves (a write), so they need ``transaction_mode="IMMEDIATE"``,
    which the docs recommend and which this checks.
    """
    if mode == "IMMEDIATE" and django.VERSION < (5, 1):
        pytest.skip("OPTIONS['transaction_mode'] is new in Django 5.1")
    counter = Counter.objects.create(value=0)
    failures: list[BaseException] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work() -> None:
        try:
            if mode == "IMMEDIATE":
                connections["default"] = _immediate_connection()
            start.wait()
            for _ in range(15):
                with KINDS[kind](name):
                    try:
                        with transaction.atomic():
                            row = Counter.objects.get(pk=counter.pk)
                            row.value += 1
                            row.save()
                    except OperationalError as e:
                        failures.append(e)
        except BaseException as e:
            errors.append(e)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert [str(e) for e in failures] == []
    assert Counter.objects.get(pk=counter.pk).value == 60


@pytest.mark.backends("db-postgresql", "db-mysql")
@pytest.mark.with_default_db
@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_on_servers_waiters_never_fail_the_holders_transaction(
    backend_alias: str, kind: str, name: str
) -> None:
    """The same on PostgreSQL and MariaDB, which lock rows, not the database: 60 of 60."""
    from django.conf import settings

    db = settings.CONFORMANCE_BACKENDS[backend_alias]
    make = {
        "mutex": lambda: lock(name, backend=backend_alias, timeout=60),
        "semaphore": lambda: semaphore(name, limit=1, backend=backend_alias, timeout=60),
    }[kind]
    counter = Counter.objects.using(db).create(value=0)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work() -> None:
        try:
            start.wait()
            for _ in range(15):
                with make(), transaction.atomic(using=db):
                    row = Counter.objects.using(db).get(pk=counter.pk)
                    row.value += 1
                    row.save(using=db)
        except BaseException as e:
            errors.append(e)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert Counter.objects.using(db).get(pk=counter.pk).value == 60
