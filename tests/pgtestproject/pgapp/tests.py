"""Tests a project writes: locks inside Django's TestCase and TransactionTestCase."""

from django.db import transaction
from django.test import TestCase, TransactionTestCase

from django_dlock import lock, locks, rwlock, semaphore

from .models import Counter


class LocksInATestCase(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        with lock("setup", timeout=0):
            cls.counter = Counter.objects.create(value=0)

    def test_a_lock(self) -> None:
        with lock(f"counter:{self.counter.pk}", timeout=0) as held:
            self.counter.value = 1
            self.counter.save()
        self.assertGreater(held.token, 0)
        self.assertEqual(locks["default"].list("counter:"), [])

    def test_a_semaphore_and_an_rwlock(self) -> None:
        with semaphore("pool", limit=2, timeout=0), rwlock("catalog", timeout=0).read():
            Counter.objects.create(value=2)

    def test_a_lock_released_at_a_rollback(self) -> None:
        with self.assertRaises(ZeroDivisionError), transaction.atomic():
            with lock("rolled-back", timeout=0, release_on_commit=True):
                Counter.objects.create(value=3)
                1 / 0  # noqa: B018
        with lock("rolled-back", timeout=10):
            pass


class LocksInATransactionTestCase(TransactionTestCase):
    def test_a_lock_inside_atomic(self) -> None:
        with transaction.atomic(), lock("tx", timeout=0):
            Counter.objects.create(value=4)
