"""The admin's break forms round-trip any lock name exactly, as a browser posts them.

A browser reads a hidden field's value from the page's HTML, where the parser
turns CR and CRLF into LF, and posts it as ``application/x-www-form-urlencoded``
with every newline normalised to CRLF (HTML's "constructing the entry list" and
"urlencoded serializer"). :func:`browser_submit` does the same to the page the
test client got, so a name that travels in a text field comes back changed.
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlencode

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client, override_settings
from django.urls import reverse

from django_dlock import HeldLock, LockLost, lock, rwlock, semaphore
from django_dlock.admin import lock_id, name_of_lock_id
from tests.test_admin import BREAK, CHANGELIST, LOCMEM, client_for, user_with

NAMES = {
    "lf": "report\nline two",
    "cr": "report\rline two",
    "crlf": "report\r\nline two",
    "trailing-lf": "report\n",
    "tab": "col\tumn",
    "unicode": "r\u00e9sum\u00e9 \u2603 \U0001f512 \u05e9\u05dc\u05d5\u05dd",
    "dash": "--all-slots",
    "spaces": "  padded  ",
    "long": "long:" + "\u00e9x" * 400,
}


class _Forms(HTMLParser):
    """Each ``<form>``'s action and its inputs' (name, value), as a browser parsed them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.forms: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {key: value or "" for key, value in attrs}
        if tag == "form":
            self.forms.append({"action": attributes.get("action", ""), "fields": []})
        elif tag == "input" and self.forms and "name" in attributes:
            self.forms[-1]["fields"].append((attributes["name"], attributes.get("value", "")))


def forms(page: Any) -> list[dict[str, Any]]:
    # HTML's input stream preprocessing: CRLF and CR become LF before tokenizing.
    text = re.sub(r"\r\n?", "\n", page.content.decode())
    parser = _Forms()
    parser.feed(text)
    return parser.forms


def _crlf(text: str) -> str:
    return re.sub(r"\r\n|\r|\n", "\r\n", text)


def browser_submit(client: Client, url: str, fields: list[tuple[str, str]], **kw: Any) -> Any:
    """POST ``fields`` urlencoded with newlines normalised to CRLF, as a browser does."""
    crlf = [(_crlf(key), _crlf(value)) for key, value in fields]
    return client.post(
        url, urlencode(crlf), content_type="application/x-www-form-urlencoded", **kw
    )


def break_through_the_pages(client: Client, held: HeldLock, kind: str | None = None) -> Any:
    """From the list, Break… on ``held``'s row, then "Yes" on the confirmation page."""
    listing = client.get(reverse(CHANGELIST))
    assert listing.status_code == 200
    form = next(
        f
        for f in forms(listing)
        if ("token", str(held.token)) in f["fields"]
        and (kind is None or ("kind", kind) in f["fields"])
    )
    confirm = browser_submit(client, form["action"], form["fields"])
    assert confirm.status_code == 200, confirm.content.decode()
    assert "Are you sure?" in confirm.content.decode()
    held.ensure()  # the confirmation page breaks nothing
    (yes,) = [f for f in forms(confirm) if ("confirm", "yes") in f["fields"]]
    return browser_submit(client, reverse(BREAK), yes["fields"], follow=True)


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
@pytest.mark.parametrize("name", list(NAMES.values()), ids=list(NAMES))
def test_a_break_through_a_browsers_form_breaks_exactly_that_name(
    name: str, admin_client: Client
) -> None:
    held = lock(name).acquire()
    done = break_through_the_pages(admin_client, held)
    body = html.unescape(done.content.decode())
    assert f"Broke the lease on {name!r}" in body
    assert "released" not in body
    with pytest.raises(LockLost):
        held.ensure()
    assert LogEntry.objects.get().object_id == f"default:{name}"


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
@pytest.mark.parametrize("kind", ["semaphore", "rwlock"])
def test_a_slot_of_a_name_with_line_breaks_is_freed_through_a_browsers_form(
    kind: str, admin_client: Client
) -> None:
    name = f"{kind}\r\nwith\rbreaks\n"
    if kind == "semaphore":
        held, other = (semaphore(name, limit=2).acquire() for _ in range(2))
    else:
        held, other = (rwlock(name).read().acquire() for _ in range(2))
    done = break_through_the_pages(admin_client, held, kind=kind)
    body = html.unescape(done.content.decode())
    assert f"Freed the {'read ' if kind == 'rwlock' else ''}slot of" in body
    assert "released" not in body
    with pytest.raises(LockLost):
        held.ensure()
    other.ensure()
    other.release()


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
@pytest.mark.parametrize("lock_id", ["not base64!", "cmVwb3J0", "_w", "=="], ids=repr)
def test_a_lock_id_that_does_not_decode_breaks_nothing_and_says_so(
    lock_id: str, admin_client: Client
) -> None:
    """Not valid base64url, or a name not held ("cmVwb3J0" is "report"), or not UTF-8."""
    with lock("report\n") as held:
        form = {"backend": "default", "lock": lock_id, "token": str(held.token)}
        done = admin_client.post(reverse(BREAK), {**form, "confirm": "yes"}, follow=True)
        held.ensure()
    body = html.unescape(done.content.decode())
    assert "Broke" not in body
    if lock_id == "cmVwb3J0":
        assert "Nothing broken: the lease on 'report' with token" in body
    else:
        assert "is not a lock id this page wrote: nothing was broken" in body
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
def test_the_break_permission_alone_is_refused_and_shows_no_holder(
    django_user_model: Any,
) -> None:
    """Holder metadata is what view_lock shows: a user with break_lock only gets 403."""
    client = client_for(user_with(django_user_model, "break_lock"))
    with lock("private", metadata={"note": "secret-note"}) as held:
        fields = [
            ("backend", "default"),
            ("lock", "cHJpdmF0ZQ"),  # "private"
            ("name", "private"),  # the form before lock ids
            ("token", str(held.token)),
        ]
        confirm = browser_submit(client, reverse(BREAK), fields)
        assert confirm.status_code == 403
        assert "secret-note" not in confirm.content.decode()
        done = browser_submit(client, reverse(BREAK), [*fields, ("confirm", "yes")])
        assert done.status_code == 403
        held.ensure()


def test_a_lock_id_is_the_base64url_of_the_utf8_name_without_padding() -> None:
    assert lock_id("report:daily") == "cmVwb3J0OmRhaWx5"
    for name in NAMES.values():
        assert name_of_lock_id(lock_id(name)) == name
    assert name_of_lock_id("cmVwb3J0OmRhaWx5=") is None  # padding is not written
