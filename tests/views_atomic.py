"""Guarded views that read, add one and write back, for tests/test_views_atomic.py.

``/<kind>/<backend>/<db>/<pk>/`` increments ``Counter`` ``pk`` on database
``db`` under a lock on ``backend``: ``kind`` is ``function`` (``@lock_view``),
``class`` (``LockRequiredMixin``) or ``slot`` (``@lock_view(limit=1)``, a
semaphore's slot). Also a fenced save through ``request.dlock``, and an admin
site with a ``LockedSaveMixin`` model.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.views import View

from django_dlock.admin import LockedModelAdmin
from django_dlock.exceptions import StaleWrite
from django_dlock.views import LockRequiredMixin, current_lock, lock_view
from tests.models import Counter, Document, LockedDocument

#: The backends the increment views lock on.
BACKENDS = ("db-postgresql", "db-mysql", "db-sqlite", "redis", "locmem")
#: Seconds between the view's return and the end of the request's
#: transaction: the window in which a lock released at the view's return
#: lets the next request read the value before it is committed.
WINDOW = 0.01


def _before_commit(view: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``view``, then wait ``WINDOW`` (still inside ATOMIC_REQUESTS' transaction).

    Stands for whatever runs between a guarded view and the commit: an
    outer decorator, a slow COMMIT.
    """

    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        response = view(*args, **kwargs)
        time.sleep(WINDOW)
        return response

    return wrapper


def _increment(db: str, pk: int) -> HttpResponse:
    row = Counter.objects.using(db).get(pk=pk)
    row.value += 1
    row.save(using=db)
    return HttpResponse(str(row.value))


def _function_view(backend: str, **options: Any) -> Callable[..., Any]:
    @_before_commit
    @lock_view("counter:{pk}", backend=backend, timeout=60, ttl=30, **options)
    def increment(request: HttpRequest, db: str, pk: int) -> HttpResponse:
        return _increment(db, pk)

    return increment


def _class_view(backend: str) -> Callable[..., Any]:
    class Increment(LockRequiredMixin, View):
        lock_key = "counter:{pk}"
        lock_backend = backend
        lock_timeout = 60
        lock_ttl = 30

        def post(self, request: HttpRequest, db: str, pk: int) -> HttpResponse:
            return _increment(db, pk)

    return _before_commit(Increment.as_view())


#: Set by a test: the fenced view waits on it while holding its lock.
gate = threading.Event()
#: Set by the fenced view once it holds its lock.
entered = threading.Event()


@lock_view("doc:{pk}", backend="locmem", ttl=30)
def fenced_edit(request: HttpRequest, pk: int) -> HttpResponse:
    """Write the document's title with the view's own fencing token; 409 if refused."""
    token = request.dlock.token  # type: ignore[attr-defined]
    if request.GET.get("wait"):
        entered.set()
        gate.wait(timeout=30)
    doc = Document.objects.get(pk=pk)
    doc.title = request.GET.get("title", "edited")
    try:
        doc.save(fencing_token=token)
    except StaleWrite as e:
        return HttpResponse(str(e), status=409)
    return HttpResponse(str(token))


class LeaseView(LockRequiredMixin, View):
    lock_key = "lease:{n}"
    lock_backend = "locmem"

    def get(self, request: HttpRequest, n: int) -> HttpResponse:
        held = self.request.dlock  # type: ignore[attr-defined]
        assert current_lock() is held
        return HttpResponse(f"{held.name} {held.token}")


site = admin.AdminSite(name="locked_admin")
site.register(LockedDocument, LockedModelAdmin)

urlpatterns = [
    path("fenced/<int:pk>/", fenced_edit),
    path("lease/<int:n>/", LeaseView.as_view()),
    path("admin/", site.urls),
]
for _backend in BACKENDS:
    urlpatterns += [
        path(f"function/{_backend}/<str:db>/<int:pk>/", _function_view(_backend)),
        path(f"class/{_backend}/<str:db>/<int:pk>/", _class_view(_backend)),
        path(f"slot/{_backend}/<str:db>/<int:pk>/", _function_view(_backend, limit=1)),
        path(
            f"unheld/{_backend}/<str:db>/<int:pk>/",
            _function_view(_backend, release_on_commit=False),
        ),
    ]
