"""Lock-guarded views, sync and async, function and class based, with concurrent requests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.http import HttpResponse
from django.test import AsyncClient, Client, override_settings
from django.test.utils import CaptureQueriesContext

from django_dlock import lock
from tests import views

pytestmark = pytest.mark.urls("tests.urls")


@pytest.fixture(autouse=True)
def _gates() -> Iterator[None]:
    views.gate.clear()
    views.entered.clear()
    # A previous test's last request through a limited view counted itself in:
    # left there, it would pass for a request of this test that never entered.
    while views.limited_entered.acquire(blocking=False):
        pass
    yield
    views.gate.set()  # never leave a request thread waiting


def _concurrently(url: str) -> tuple[Any, Any, Any]:
    """A first request that holds the lock, a second while it does, a third after."""
    first: list[Any] = []
    thread = threading.Thread(target=lambda: first.append(Client().get(url)))
    thread.start()
    assert views.entered.wait(timeout=30)
    second = Client().get(url)
    views.gate.set()
    thread.join(timeout=30)
    third = Client().get(url)
    return first[0], second, third


@pytest.mark.parametrize(
    "url", ["/order/1/", "/class/order/2/", "/redis/order/3/"], ids=["function", "class", "redis"]
)
def test_a_request_that_finds_the_lock_held_gets_423(
    url: str, request: pytest.FixtureRequest
) -> None:
    if "redis" in url:
        request.getfixturevalue("redis_servers")
    first, second, third = _concurrently(url)
    assert first.status_code == 200
    assert second.status_code == 423
    # The holder's lease is 20 s, renewed every ttl/3: what is left of it.
    assert 1 <= int(second["Retry-After"]) <= 20
    assert "is locked by another request" in second.content.decode()
    assert third.status_code == 200


@pytest.mark.parametrize(
    ("holder", "said"),
    [
        (
            {"task_name": "invoices.tasks.regenerate", "task_id": "abc"},
            "locked by a background task",
        ),
        ({"note": "by hand"}, "locked by another request or process"),
    ],
    ids=["task", "other"],
)
def test_the_423_body_says_whether_a_task_holds_it(holder: dict[str, str], said: str) -> None:
    """A task holding the key is not "another request"; its name and id stay private."""
    with lock("order:8", backend="locmem", ttl=7, metadata=holder):
        body = Client().get("/409/order/8/").content.decode()
    assert f"'order:8' is {said}; retry after" in body
    assert "invoices" not in body and "abc" not in body


def test_the_status_can_be_409_and_requests_for_other_keys_pass() -> None:
    with lock("order:5", backend="locmem", ttl=7):
        response = Client().get("/409/order/5/")
        assert response.status_code == 409
        assert 1 <= int(response["Retry-After"]) <= 7
        assert Client().get("/409/order/6/").status_code == 200


def test_timeout_waits_for_the_holder() -> None:
    held = lock("order:8", backend="locmem").acquire()
    threading.Timer(0.3, held.release).start()
    response = Client().get("/waits/order/8/")
    assert (response.status_code, response.content) == (200, b"waited")


@pytest.mark.django_db
def test_the_key_can_name_the_user(django_user_model: Any) -> None:
    alice = django_user_model.objects.create_user("alice")
    bob = django_user_model.objects.create_user("bob")
    with lock(f"cart:{alice.pk}", backend="locmem"):
        as_alice, as_bob = Client(), Client()
        as_alice.force_login(alice)
        as_bob.force_login(bob)
        assert as_alice.get("/cart/").status_code == 423
        assert as_bob.get("/cart/").status_code == 200


def test_a_key_that_names_an_unknown_argument_is_an_error() -> None:
    with pytest.raises(ValueError, match="names 'missing', which is neither a URL keyword"):
        Client().get("/misnamed/1/")


def test_the_lock_is_released_when_the_view_raises() -> None:
    with pytest.raises(RuntimeError, match="the view failed"):
        Client().post("/class/order/9/")
    assert Client().get("/409/order/9/").status_code == 200


@pytest.mark.parametrize("url", ["/async/order/11/", "/async-class/order/12/"])
def test_async_views_answer_423_while_held(url: str) -> None:
    async def scenario() -> tuple[Any, Any, Any]:
        views.async_gate = asyncio.Event()
        client = AsyncClient()
        first = asyncio.create_task(client.get(url))
        while not views.entered.is_set():
            await asyncio.sleep(0.01)
        second = await client.get(url)
        views.async_gate.set()
        return await first, second, await client.get(url)

    first, second, third = asyncio.run(scenario())
    assert first.status_code == 200 and "async" in first.content.decode()
    assert second.status_code == 423
    assert third.status_code == 200


def test_bad_options_fail_where_the_view_is_defined() -> None:
    from django_dlock.views import lock_view

    with pytest.raises(TypeError, match="non-empty str"):
        lock_view("")
    with pytest.raises(ValueError):
        lock_view("x:{id}", ttl=-1)


@override_settings(
    DLOCK_BACKENDS={"default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}}
)
def test_the_default_backend_is_used_when_none_is_named() -> None:
    from django_dlock.views import lock_view

    @lock_view("plain:{n}")
    def plain(request: Any, n: int) -> Any:
        from django.http import HttpResponse

        return HttpResponse("ok")

    from django.test import RequestFactory

    with lock("plain:1"):
        assert plain(RequestFactory().get("/"), n=1).status_code == 423
    assert plain(RequestFactory().get("/"), n=1).status_code == 200


@pytest.mark.parametrize("url", ["/export/csv/", "/class/export/pdf/"], ids=["function", "class"])
def test_a_limit_lets_n_requests_in_and_answers_429_past_them(url: str) -> None:
    responses: list[Any] = []
    threads = [
        threading.Thread(target=lambda: responses.append(Client().get(url))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for _ in range(2):  # both are inside the view at once
        assert views.limited_entered.acquire(timeout=30)
    third = Client().get(url)
    assert third.status_code == 429
    assert 1 <= int(third["Retry-After"]) <= 20
    assert "2 requests at once" in third.content.decode()
    views.gate.set()
    for t in threads:
        t.join(timeout=30)
    assert sorted(r.status_code for r in responses) == [200, 200]
    assert Client().get(url).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_a_url_argument_no_lock_service_can_store_is_a_bad_request() -> None:
    """Issue 27 review: ``/named/a%00b`` gave a 500 (ValueError from acquire())."""
    from django.core.exceptions import BadRequest
    from django.test import RequestFactory

    from django_dlock.views import lock_view

    @lock_view("named:{slug}", backend="locmem")
    def named(request: Any, slug: str) -> HttpResponse:
        return HttpResponse(slug)

    @lock_view("named:{slug}", backend="locmem")
    async def anamed(request: Any, slug: str) -> HttpResponse:
        return HttpResponse(slug)

    request = RequestFactory().get("/")
    for bad in ("a\x00b", "a\ud800b"):
        with pytest.raises(BadRequest, match="lock name"):
            named(request, slug=bad)
        with pytest.raises(BadRequest, match="lock name"):
            asyncio.run(anamed(request, slug=bad))
    assert named(request, slug="a\nb").status_code == 200


def test_a_limit_on_a_backend_without_semaphores_is_a_check_error_at_startup() -> None:
    """E010 for guarded views: every request would be a 500 (LockConfigurationError)."""
    import gc

    from django.core import checks
    from django.views import View

    from django_dlock.views import LockRequiredMixin, lock_view

    def errors() -> set[object]:
        return {m.obj for m in checks.run_checks() if m.id == "django_dlock.E010"}

    @lock_view("limited-fn:{id}", backend="redlock", limit=2)
    def limited_fn(request: Any, id: int) -> HttpResponse:
        return HttpResponse("ok")

    @lock_view("one-fn:{id}", backend="redlock")
    def one_fn(request: Any, id: int) -> HttpResponse:
        return HttpResponse("ok")

    class LimitedView(LockRequiredMixin, View):
        lock_key = "limited-cbv"
        lock_backend = "redlock"
        lock_limit = 3

    class LimitedOnLocMem(LockRequiredMixin, View):
        lock_key = "limited-cbv"
        lock_backend = "locmem"
        lock_limit = 3

    prefix = f"{__name__}.test_a_limit_on_a_backend_without_semaphores_is_a_check_error_at_startup"
    found = {str(obj) for obj in errors() if str(obj).startswith(prefix)}
    assert found == {f"{prefix}.<locals>.limited_fn", f"{prefix}.<locals>.LimitedView"}
    message = next(m for m in checks.run_checks() if str(m.obj).endswith("limited_fn"))
    assert message.is_serious() and "'redlock'" in message.msg and "limit=2" in message.msg
    # Gone with the views (held weakly): a test's views do not haunt later checks.
    del limited_fn, one_fn, LimitedView, LimitedOnLocMem, message
    gc.collect()
    assert not {str(obj) for obj in errors() if str(obj).startswith(prefix)}


def test_a_view_on_an_alias_dlock_backends_lacks_is_a_check_warning() -> None:
    """W005: review of issue 30 (a typo passed the checks, and every request was a 500)."""
    import gc

    from django.core import checks
    from django.views import View

    from django_dlock.views import LockRequiredMixin, lock_view

    def errors() -> dict[str, str]:
        return {str(m.obj): m.msg for m in checks.run_checks() if m.id == "django_dlock.W005"}

    assert errors() == {}

    @lock_view("typo-fn", backend="defualt")
    def typo_fn(request: Any) -> HttpResponse:
        return HttpResponse("ok")

    class TypoView(LockRequiredMixin, View):
        lock_key = "typo-cbv"
        lock_backend = "redsi"

    class Plain(LockRequiredMixin, View):
        lock_key = "plain"

    made = Plain.as_view(lock_backend="lcomem")
    found = errors()
    assert {obj.rsplit(".", 1)[-1] for obj in found} == {"typo_fn", "TypoView", "Plain"}
    assert any("'defualt'" in m for m in found.values())
    assert any("'redsi'" in m for m in found.values())
    assert any("'lcomem'" in m for m in found.values())
    del typo_fn, TypoView, Plain, made
    gc.collect()
    assert errors() == {}


def test_a_class_based_view_s_bad_options_raise_where_it_is_defined_or_made() -> None:
    """As lock_view's do: LockRequiredMixin's options, and those given to as_view()."""
    import gc

    from django.core import checks
    from django.views import View

    from django_dlock.views import LockRequiredMixin

    with pytest.raises(ValueError):

        class NoRoom(LockRequiredMixin, View):
            lock_key = "no-room"
            lock_limit = 0

    with pytest.raises(ValueError):

        class NegativeTimeout(LockRequiredMixin, View):
            lock_key = "negative"
            lock_timeout = -5

    with pytest.raises(TypeError, match="non-empty str"):

        class EmptyKey(LockRequiredMixin, View):
            lock_key = ""
            lock_timeout = 1  # a key is what makes it a guarded view: give one

        EmptyKey.as_view(lock_key="")

    class Plain(LockRequiredMixin, View):
        lock_key = "plain"

    with pytest.raises(ValueError):
        Plain.as_view(lock_limit=0)
    with pytest.raises(ValueError):
        Plain.as_view(lock_ttl=-1)
    view = Plain.as_view(lock_backend="redlock", lock_limit=2)
    found = [m for m in checks.run_checks() if m.id == "django_dlock.E010"]
    assert any(str(m.obj).endswith(".Plain") and "'redlock'" in m.msg for m in found), found
    del view, found, Plain
    gc.collect()
    assert not [m for m in checks.run_checks() if str(m.obj).endswith(".Plain")]


SESSIONS_AND_AUTH = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]


@pytest.mark.django_db(transaction=True)
@override_settings(MIDDLEWARE=SESSIONS_AND_AUTH)
def test_an_async_guarded_view_serves_a_logged_in_user(django_user_model: Any) -> None:
    """request.user loads the session and the user from the database, which Django refuses
    on the event loop: every async guarded view answered 500 to a logged-in user. The user
    is now read only for a key that names it, and then with ``await request.auser()``."""
    user = django_user_model.objects.create_user("async-buyer", password="pw")
    client = AsyncClient()
    client.force_login(user)

    async def scenario() -> tuple[Any, Any]:
        return await client.get("/async/pay/31/"), await client.get("/async/cart/")

    paid, cart = asyncio.run(scenario())
    assert (paid.status_code, paid.content) == (200, b"paid 31")
    assert (cart.status_code, cart.content.decode()) == (200, f"cart:{user.pk}")


@pytest.mark.django_db
@override_settings(MIDDLEWARE=SESSIONS_AND_AUTH)
def test_a_key_without_the_user_does_not_read_the_session(django_user_model: Any) -> None:
    """Reading request.user costs two queries and makes the response vary on the cookie."""
    client = Client()
    client.force_login(django_user_model.objects.create_user("buyer", password="pw"))
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/409/order/32/")  # locmem: no query of its own
    assert response.status_code == 200
    assert "Cookie" not in response.get("Vary", "")
    assert len(queries) == 0


@pytest.mark.django_db(transaction=True)
@override_settings(MIDDLEWARE=[*SESSIONS_AND_AUTH, "tests.views.HeaderUserMiddleware"])
def test_an_async_view_keys_on_the_user_a_middleware_set(django_user_model: Any) -> None:
    """A middleware that sets request.user (a token, RemoteUserMiddleware) leaves
    request.auser() answering AnonymousUser: keyed on it, every user got "cart:None"."""
    alice = django_user_model.objects.create_user("alice", password="pw")
    bob = django_user_model.objects.create_user("bob", password="pw")

    async def scenario() -> list[Any]:
        client = AsyncClient()
        return [await client.get("/async/cart/", headers={"X-User": u}) for u in ("alice", "bob")]

    names = [r.content.decode() for r in asyncio.run(scenario())]
    assert names == [f"cart:{alice.pk}", f"cart:{bob.pk}"]


@pytest.mark.django_db
@override_settings(MIDDLEWARE=SESSIONS_AND_AUTH)
def test_a_url_argument_named_like_the_user_field_wins(django_user_model: Any) -> None:
    """staff/users/<user_pk>/reset/ locks the user in the URL, not the staff member asking."""
    staff = django_user_model.objects.create_user("staff", password="pw")
    client = Client()
    client.force_login(staff)
    assert client.get("/staff/users/7/reset/").content.decode() == "reset:7"
