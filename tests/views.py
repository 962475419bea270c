"""Views for tests/test_views.py: each holds its lock until the test lets it go."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views import View

from django_dlock.views import LockRequiredMixin, lock_view

#: Set by a test: a guarded view waits on it while holding its lock.
gate = threading.Event()
#: Set by the view once it runs (it holds the lock then).
entered = threading.Event()
async_gate: asyncio.Event | None = None


def _hold() -> None:
    entered.set()
    gate.wait(timeout=30)


@lock_view("order:{order_id}", backend="locmem", ttl=20)
def order(request: HttpRequest, order_id: int) -> HttpResponse:
    _hold()
    return HttpResponse(f"order {order_id}")


@lock_view("order:{order_id}", backend="redis", ttl=20)
def order_redis(request: HttpRequest, order_id: int) -> HttpResponse:
    _hold()
    return HttpResponse(f"order {order_id}")


@lock_view("order:{order_id}", backend="locmem", status=409)
def order_409(request: HttpRequest, order_id: int) -> HttpResponse:
    return HttpResponse("ok")


@lock_view("order:{order_id}", backend="locmem", timeout=10)
def order_waits(request: HttpRequest, order_id: int) -> HttpResponse:
    return HttpResponse("waited")


@lock_view("cart:{user_pk}", backend="locmem")
def cart(request: HttpRequest) -> HttpResponse:
    return HttpResponse("cart")


@lock_view("pay:{order_id}", backend="locmem")
async def async_pay(request: HttpRequest, order_id: int) -> HttpResponse:
    return HttpResponse(f"paid {order_id}")


@lock_view("cart:{user_pk}", backend="locmem")
async def async_cart(request: HttpRequest) -> HttpResponse:
    return HttpResponse(request.dlock.name)  # type: ignore[attr-defined]


@lock_view("reset:{user_pk}", backend="locmem")
def reset_password(request: HttpRequest, user_pk: int) -> HttpResponse:
    return HttpResponse(request.dlock.name)  # type: ignore[attr-defined]


class HeaderUserMiddleware:
    """Sets request.user from an X-User header, as token or SSO middleware do."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> Any:
        from django.contrib.auth import get_user_model

        username = request.headers.get("X-User")
        if username:
            request.user = get_user_model().objects.get(username=username)
        return self.get_response(request)


@lock_view("order:{missing}", backend="locmem")
def misnamed(request: HttpRequest, order_id: int) -> HttpResponse:
    return HttpResponse("never")


@lock_view("order:{order_id}", backend="locmem", ttl=20)
async def async_order(request: HttpRequest, order_id: int) -> HttpResponse:
    assert async_gate is not None
    entered.set()
    await async_gate.wait()
    return HttpResponse(f"async order {order_id}")


class OrderView(LockRequiredMixin, View):
    lock_key = "order:{order_id}"
    lock_backend = "locmem"
    lock_ttl = 20

    def get(self, request: HttpRequest, order_id: int) -> HttpResponse:
        _hold()
        return HttpResponse(f"class order {order_id}")

    def post(self, request: HttpRequest, order_id: int) -> HttpResponse:
        raise RuntimeError("the view failed")


class AsyncOrderView(LockRequiredMixin, View):
    lock_key = "order:{order_id}"
    lock_backend = "locmem"

    async def get(self, request: HttpRequest, order_id: int) -> HttpResponse:
        assert async_gate is not None
        entered.set()
        await async_gate.wait()
        return HttpResponse(f"async class order {order_id}")


#: Counts requests inside the limited views; a test reads it.
limited_entered = threading.Semaphore(0)


@lock_view("export:{kind}", backend="locmem", ttl=20, limit=2)
def export(request: HttpRequest, kind: str) -> HttpResponse:
    limited_entered.release()
    gate.wait(timeout=30)
    return HttpResponse(f"export {kind}")


class ExportView(LockRequiredMixin, View):
    lock_key = "export:{kind}"
    lock_backend = "locmem"
    lock_ttl = 20
    lock_limit = 2

    def get(self, request: HttpRequest, kind: str) -> HttpResponse:
        limited_entered.release()
        gate.wait(timeout=30)
        return HttpResponse(f"class export {kind}")
