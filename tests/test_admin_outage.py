"""The admin's Locks page answers within its time limit when a backend does not, and
renders with the other backends listed when one is misconfigured or down."""

from __future__ import annotations

import contextlib
import html
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib import admin
from django.test import Client, override_settings
from django.urls import reverse

from django_dlock import lock
from django_dlock.admin import lock_id
from django_dlock.models import LockListing
from tests.test_admin import BREAK, CHANGELIST, LOCMEM, rows

#: The page's limit in these tests; the silent Redis's own timeouts take 10 s.
LIMIT = 1.0


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers, until the test ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in accepted:
            conn.close()
        listener.close()


@pytest.fixture
def short_limit(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(admin.site._registry[LockListing], "listing_timeout", LIMIT)
    return LIMIT


def messages_of(page: Any) -> list[str]:
    found = re.findall(r'<li class="(?:error|warning)">(.*?)</li>', page.content.decode(), re.S)
    return [html.unescape(text) for text in found]


@pytest.mark.django_db
def test_a_backend_that_never_answers_does_not_hold_the_page(
    name: str, admin_client: Client, short_limit: float
) -> None:
    with silent_server() as port:
        silent = {
            "BACKEND": "django_dlock.backends.redis.RedisBackend",
            "LOCATION": f"redis://:hunter2@127.0.0.1:{port}/0",
        }
        with override_settings(DLOCK_BACKENDS={**LOCMEM, "silent": silent}), lock(name) as held:
            started = time.monotonic()
            page = admin_client.get(reverse(CHANGELIST))
            took = time.monotonic() - started
            assert page.status_code == 200
            assert rows(page) == [{"backend": "default", "name": name, "token": str(held.token)}]
            assert messages_of(page) == [f"Backend silent did not answer within {LIMIT:g} s."]
            assert "hunter2" not in page.content.decode()
            # Redis's own timeouts would take 10 s; the page keeps to its limit.
            assert took < 5 * LIMIT

            # While the first listing still waits, the page does not start another.
            again = admin_client.get(reverse(CHANGELIST))
            (busy,) = messages_of(again)
            assert busy.startswith("Backend silent has not answered a listing for ")

            form = {"backend": "silent", "lock": lock_id(name), "token": "1", "confirm": "yes"}
            started = time.monotonic()
            done = admin_client.post(reverse(BREAK), form, follow=True)
            assert time.monotonic() - started < 5 * LIMIT
            body = html.unescape(done.content.decode())
            assert "Backend silent " in body and "nothing was broken" in body
            assert "released" not in body


BAD = {
    "unknown-option": {
        "BACKEND": "django_dlock.backends.redis.RedisBackend",
        "LOCATION": "redis://:hunter2@127.0.0.1:6379/0",
        "OPTIONS": {"no_such_option": 1},
    },
    "no-such-class": {"BACKEND": "no.such.Backend", "LOCATION": "redis://:hunter2@x/0"},
    "not-a-backend": {"BACKEND": "django.contrib.auth.backends.ModelBackend"},
}


@pytest.mark.django_db
@pytest.mark.parametrize("params", list(BAD.values()), ids=list(BAD))
def test_a_misconfigured_backend_is_named_and_the_rest_are_listed(
    params: dict[str, Any], name: str, admin_client: Client
) -> None:
    with override_settings(DLOCK_BACKENDS={**LOCMEM, "bad": params}), lock(name) as held:
        page = admin_client.get(reverse(CHANGELIST))
        assert page.status_code == 200
        assert rows(page) == [{"backend": "default", "name": name, "token": str(held.token)}]
        (message,) = messages_of(page)
        assert message.startswith("Backend bad is not configured correctly: ")
        assert "hunter2" not in page.content.decode()
        filtered = admin_client.get(reverse(CHANGELIST), {"backend": "bad"})
        assert filtered.status_code == 200
        assert messages_of(filtered) == [message]
        form = {"backend": "bad", "lock": lock_id(name), "token": "1", "confirm": "yes"}
        done = admin_client.post(reverse(BREAK), form, follow=True)
        assert done.status_code == 200
        assert message in html.unescape(done.content.decode())
        held.ensure()


@pytest.mark.django_db  # a TestCase's transaction: nothing the test writes is committed
def test_a_lease_the_request_s_own_transaction_holds_is_listed(
    name: str, admin_client: Client
) -> None:
    """The database backend is listed on the request's connection, not another thread's."""
    database = {"default": {"BACKEND": "django_dlock.backends.database.DatabaseBackend"}}
    with override_settings(DLOCK_BACKENDS=database):
        with lock(name) as held:
            page = admin_client.get(reverse(CHANGELIST))
            assert page.status_code == 200
            assert rows(page) == [{"backend": "default", "name": name, "token": str(held.token)}]
