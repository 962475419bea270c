"""The public contract used the way a newcomer would: default settings, TestCase transactions.

Run as a separate pytest session by ``tests/test_newcomer.py`` (the settings
differ from the main suite's).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.test import TestCase

from django_dlock import LockLost, LockTimeout, lock, locks
from django_dlock.backends.database import DatabaseBackend
from django_dlock.signals import lock_lost


@pytest.mark.django_db
def test_default_backend_is_the_database() -> None:
    assert isinstance(locks["default"], DatabaseBackend)


@pytest.mark.django_db
def test_lock_inside_the_test_transaction() -> None:
    User.objects.create(username="writes-first")  # the test transaction now holds a write
    with lock("report:daily", ttl=30, timeout=10) as held:
        assert isinstance(held.token, int)
        assert held.name == "report:daily"
        held.ensure()
        with pytest.raises(LockTimeout):
            lock("report:daily", timeout=0).acquire()
        [info] = locks["default"].list(prefix="report:")
        assert info.token == held.token
    with lock("report:daily", timeout=0) as again:
        assert again.token > held.token


@pytest.mark.django_db
def test_watchdog_renews_inside_the_test_transaction() -> None:
    User.objects.create(username="writes-first")
    with lock("renewed", ttl=0.5) as held:
        time.sleep(1.6)
        held.ensure()
        with pytest.raises(LockTimeout):
            lock("renewed", timeout=0).acquire()


@pytest.mark.django_db
def test_broken_lock_is_lost() -> None:
    lost = threading.Event()

    def on_lost(sender: object, **kwargs: object) -> None:
        lost.set()

    lock_lost.connect(on_lost)
    try:
        held = lock("broken", ttl=0.5).acquire()
        assert locks["default"].break_lock("broken") is True
        with pytest.raises(LockLost):
            held.ensure()
        assert lost.is_set()
    finally:
        lock_lost.disconnect(on_lost)


@pytest.mark.django_db
def test_decorator() -> None:
    @lock("invoice:{invoice_id}", timeout=0)
    def regenerate(invoice_id: int) -> list[str]:
        return [i.name for i in locks["default"].list("invoice:")]

    assert regenerate(42) == ["invoice:42"]
    assert locks["default"].list("invoice:") == []


@pytest.mark.django_db(transaction=True)
def test_threads_with_transactional_db() -> None:
    tokens: list[int] = []
    holder = lock("shared").acquire()

    def waiter() -> None:
        with lock("shared", timeout=30) as held:
            tokens.append(held.token)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)
    assert tokens == []
    holder.release()
    thread.join(30)
    assert tokens and tokens[0] > holder.token


class LockInTestCase(TestCase):
    def test_atomic_block_and_lock(self) -> None:
        with transaction.atomic():
            User.objects.create(username="inside-atomic")
            with lock("in-atomic", ttl=0.5) as held:
                time.sleep(1.2)
                held.ensure()
        self.assertEqual(locks["default"].list("in-atomic"), [])

    def test_rolled_back_acquisition_is_lost(self) -> None:
        with self.assertRaises(RuntimeError), transaction.atomic():
            held = lock("rolled-back", ttl=30).acquire()
            raise RuntimeError("roll the savepoint back")
        with self.assertRaises(LockLost):
            held.ensure()
        with lock("rolled-back", timeout=0) as successor:
            self.assertGreater(successor.token, 0)


@pytest.mark.django_db(transaction=True)
def test_threads_hammering_the_in_memory_database() -> None:
    """Threads share Django's in-memory test database: SQLite answers "locked" at once there."""
    counter = 0
    errors: list[BaseException] = []

    def worker() -> None:
        nonlocal counter
        try:
            for _ in range(25):
                with lock("hammered", timeout=60):
                    value = counter
                    time.sleep(0.0005)
                    counter = value + 1
        except BaseException as e:  # collected and asserted on below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert counter == 150
