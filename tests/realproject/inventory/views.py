"""Guarded views doing read-modify-write, as a project writes them.

Every write here is "read, add one, write back", with nothing but the lock
between concurrent requests: a request that runs while another still holds
its uncommitted write loses that write. The load script (../load.py) counts
the increments each path answered 200 to against the value left in the
database.
"""

from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt

from django_dlock import StaleWrite, lock
from django_dlock.views import LockRequiredMixin, lock_view

from .models import Account, Book, Counter, Warehouse
from .tasks import bump_tally

WAIT = settings.VIEW_LOCK_TIMEOUT
V = TypeVar("V", bound=Callable[..., Any])


def non_atomic(view: V) -> V:
    """Out of ATOMIC_REQUESTS on every database: Django refuses async views in it.

    ``transaction.non_atomic_requests`` used bare names only "default".
    """
    for alias in settings.DATABASES:
        view = transaction.non_atomic_requests(using=alias)(view)
    return view


def _bump(name: str) -> int:
    counter, _ = Counter.objects.get_or_create(name=name)
    counter.value += 1
    counter.save(update_fields=["value"])
    return counter.value


@csrf_exempt
@lock_view("counter:{name}", timeout=WAIT)
def bump(request: HttpRequest, name: str) -> JsonResponse:
    return JsonResponse({"value": _bump(name)})


@method_decorator(csrf_exempt, name="dispatch")
class BumpView(LockRequiredMixin, View):
    lock_key = "counter:{name}"
    lock_timeout = WAIT

    def post(self, request: HttpRequest, name: str) -> JsonResponse:
        return JsonResponse({"value": _bump(name)})


@csrf_exempt
@non_atomic
@lock_view("counter:{name}", timeout=WAIT)
async def abump(request: HttpRequest, name: str) -> JsonResponse:
    counter, _ = await Counter.objects.aget_or_create(name=name)
    counter.value += 1
    await counter.asave(update_fields=["value"])
    return JsonResponse({"value": counter.value})


class AsyncBumpView(LockRequiredMixin, View):
    lock_key = "counter:{name}"
    lock_timeout = WAIT

    async def post(self, request: HttpRequest, name: str) -> JsonResponse:
        counter, _ = await Counter.objects.aget_or_create(name=name)
        counter.value += 1
        await counter.asave(update_fields=["value"])
        return JsonResponse({"value": counter.value})


@csrf_exempt
def stock_book(request: HttpRequest, name: str) -> JsonResponse:
    book, created = Book.objects.get_or_create(name=name)
    return JsonResponse({"pk": book.pk, "created": created})


@csrf_exempt
@lock_view("book:{name}", timeout=WAIT)
def sell_book(request: HttpRequest, name: str) -> JsonResponse:
    book = Book.objects.get(name=name)
    book.sold += 1
    book.save()  # LockedSaveMixin: the item's own lock, and a fenced save
    return JsonResponse({"sold": book.sold})


@csrf_exempt
@lock_view("book:{name}", timeout=WAIT)
def discard_book(request: HttpRequest, name: str) -> JsonResponse:
    """Delete the book (and its Item row); a second delete finds nothing."""
    try:
        book = Book.objects.get(name=name)
    except Book.DoesNotExist:
        return JsonResponse({"deleted": 0}, status=404)
    try:
        _, per_model = book.delete()  # LockedSaveMixin: under the item's lock
    except StaleWrite as e:
        return JsonResponse({"deleted": 0, "refused": str(e)}, status=409)
    return JsonResponse({"deleted": per_model.get("inventory.Book", 0)})


@csrf_exempt
@lock_view("warehouse:{name}", timeout=WAIT)
def restock(request: HttpRequest, name: str) -> JsonResponse:
    warehouse, _ = Warehouse.objects.get_or_create(name=name)
    warehouse.stock += 1
    warehouse.save()  # LockedSaveMixin on the child of a plain model: fenced
    return JsonResponse({"stock": warehouse.stock})


@csrf_exempt
def credit(request: HttpRequest, name: str) -> JsonResponse:
    """A lock held until the second database's transaction commits."""
    options: dict[str, Any] = {}
    if settings.LEDGER_LOCK_USING is not None:
        options["using"] = settings.LEDGER_LOCK_USING
    with transaction.atomic(using="ledger"):
        with lock(
            f"account:{name}", backend="ledger", timeout=WAIT, release_on_commit=True, **options
        ):
            account, _ = Account.objects.get_or_create(name=name)
            account.balance += 1
            account.save(update_fields=["balance"])
    return JsonResponse({"balance": account.balance})


@csrf_exempt
def enqueue_tally(request: HttpRequest, name: str) -> JsonResponse:
    transaction.on_commit(lambda: bump_tally.delay(name))
    return JsonResponse({"queued": name})
