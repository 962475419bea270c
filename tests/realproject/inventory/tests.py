"""The project's own tests, run by ``manage.py test`` on PostgreSQL.

They take locks inside Django's TestCase (each test runs in a transaction that
is rolled back), as a project's tests do; the run must end with exit status 0
and drop its test databases.
"""

from django.test import TestCase

from django_dlock import lock, locks

from .models import Account, Book, Counter, Tally, Warehouse
from .tasks import bump_tally


class LockInTestCaseTests(TestCase):
    databases = {"default", "ledger"}

    def test_lock_is_listed_while_held(self) -> None:
        with lock("inventory:report", timeout=0) as held:
            self.assertGreater(held.token, 0)
            names = [info.name for info in locks["default"].list(prefix="inventory:")]
            self.assertEqual(names, ["inventory:report"])
        self.assertEqual(locks["default"].list(prefix="inventory:"), [])

    def test_lock_on_the_second_database(self) -> None:
        with lock("inventory:ledger", backend="ledger", timeout=0) as held:
            self.assertGreater(held.token, 0)


class GuardedViewTests(TestCase):
    databases = {"default", "ledger"}

    def test_sync_views_increment(self) -> None:
        for path in ("fn", "cbv"):
            for expected in (1, 2):
                response = self.client.post(f"/counters/{path}/{path}/")
                self.assertEqual(response.status_code, 200)
                self.assertEqual(response.json(), {"value": expected})
        self.assertEqual(Counter.objects.get(name="fn").value, 2)

    async def test_async_views_increment(self) -> None:
        for path in ("async-fn", "async-cbv"):
            response = await self.async_client.post(f"/counters/{path}/{path}/")
            self.assertEqual(response.status_code, 200)
            self.assertEqual(response.json(), {"value": 1})

    def test_credit_on_the_second_database(self) -> None:
        for expected in (1, 2):
            response = self.client.post("/accounts/alice/credit/")
            self.assertEqual(response.status_code, 200)
            self.assertEqual(response.json(), {"balance": expected})
        self.assertEqual(Account.objects.get(name="alice").balance, 2)

    def test_task_increments(self) -> None:
        self.assertEqual(bump_tally.apply(args=["t"]).get(), 1)
        self.assertEqual(bump_tally.apply(args=["t"]).get(), 2)
        self.assertEqual(Tally.objects.get(name="t").value, 2)


class FencedInheritanceTests(TestCase):
    def test_fenced_save_of_a_child_of_a_fenced_model(self) -> None:
        book = Book.objects.create(name="dune")
        response = self.client.post("/books/dune/sell/")
        self.assertEqual(response.status_code, 200)
        book.refresh_from_db()
        self.assertEqual(book.sold, 1)
        self.assertGreater(book.fence, 0)

    def test_fenced_save_of_a_fenced_child_of_a_plain_model(self) -> None:
        response = self.client.post("/warehouses/north/restock/")
        self.assertEqual(response.status_code, 200)
        response = self.client.post("/warehouses/north/restock/")
        self.assertEqual(response.status_code, 200)
        warehouse = Warehouse.objects.get(name="north")
        self.assertEqual(warehouse.stock, 2)
        self.assertGreater(warehouse.fence, 0)

    def test_delete_under_the_lock(self) -> None:
        Book.objects.create(name="gone")
        self.assertEqual(self.client.post("/books/gone/discard/").json(), {"deleted": 1})
        self.assertEqual(self.client.post("/books/gone/discard/").status_code, 404)
        self.assertFalse(Book.objects.filter(name="gone").exists())
