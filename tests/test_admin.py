"""The admin's "Locks" page: listing and breaking on every backend, permissions,
CSRF, escaping, paging, filters and auto-refresh (through Django's test client)."""

from __future__ import annotations

import contextlib
import html
import re
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission
from django.test import Client, override_settings
from django.urls import reverse

from django_dlock import HeldLock, Lock, LockLost, LockNotOwned, lock, locks, rwlock, semaphore
from django_dlock.admin import lock_id
from django_dlock.backends.base import BaseLockBackend
from django_dlock.celery.parking import park_payload
from django_dlock.signals import lock_broken
from tests.servers import free_port

CHANGELIST = "admin:django_dlock_locklisting_changelist"
BREAK = "admin:django_dlock_locklisting_break"
LOCMEM = {"default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}}
XSS = "<script>alert(1)</script>"


def rows(response: Any) -> list[dict[str, str]]:
    """The lease rows of the list page, as their data-* attributes (unescaped)."""
    found = re.findall(
        r'<tr class="lock" data-backend="([^"]*)" data-name="([^"]*)" data-token="([^"]*)">',
        response.content.decode(),
    )
    return [
        {"backend": html.unescape(b), "name": html.unescape(n), "token": t} for b, n, t in found
    ]


def slot_rows(response: Any) -> list[dict[str, str]]:
    """The semaphore and read/write lock rows: data-* attributes and each cell's text."""
    found = []
    for attributes, body in re.findall(
        r'<tr class="slot"([^>]*)>(.*?)</tr>', response.content.decode(), re.S
    ):
        row = {
            key: html.unescape(value)
            for key, value in re.findall(r'data-([a-z]+)="([^"]*)"', attributes)
        }
        for field, text in re.findall(
            r'<t[dh] class="field-([a-z-]+)[^"]*"[^>]*>(.*?)</t[dh]>', body, re.S
        ):
            # The holder's cell: its summary line, not the metadata it unfolds.
            text = re.sub(r"</summary>.*", "", text, flags=re.S)
            row[field] = html.unescape(re.sub(r"<[^>]+>|\s+", " ", text)).strip()
        found.append(row)
    return found


def user_with(django_user_model: Any, *codenames: str, staff: bool = True) -> Any:
    user = django_user_model.objects.create_user(
        username=f"u{'-'.join(codenames) or 'none'}", password="pw", is_staff=staff
    )
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_dlock", codename__in=codenames)
    )
    return user


def client_for(user: Any, **kwargs: Any) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


# --- every backend -----------------------------------------------------------------------


@pytest.mark.with_default_db
def test_list_and_break_on_every_backend(
    backend_alias: str, backend: BaseLockBackend, name: str, admin_client: Client
) -> None:
    broken: list[tuple[str, str, int | None]] = []

    def on_broken(sender: Any, **kwargs: Any) -> None:
        broken.append((kwargs["backend"], kwargs["name"], kwargs["token"]))

    held = lock(name, backend=backend_alias, metadata={"note": "nightly"}).acquire()
    page = admin_client.get(reverse(CHANGELIST), {"backend": backend_alias, "q": name})
    assert page.status_code == 200
    assert rows(page) == [{"backend": backend_alias, "name": name, "token": str(held.token)}]
    assert f"{held.holder['host']}:{held.holder['pid']}" in page.content.decode()

    filters = urlencode({"backend": backend_alias, "q": name})
    form = {
        "backend": backend_alias,
        "lock": lock_id(name),
        "token": str(held.token),
        "filters": filters,
    }
    confirm = admin_client.post(reverse(BREAK), form)
    assert confirm.status_code == 200
    assert "Are you sure?" in confirm.content.decode()
    held.ensure()  # the first POST only asks

    lock_broken.connect(on_broken)
    try:
        done = admin_client.post(reverse(BREAK), {**form, "confirm": "yes"}, follow=True)
    finally:
        lock_broken.disconnect(on_broken)
    # Back to the list as it was filtered.
    assert done.redirect_chain == [(f"{reverse(CHANGELIST)}?{filters}", 302)]
    assert rows(done) == []
    assert f"Broke the lease on {name!r} on {backend_alias}" in html.unescape(
        done.content.decode()
    )
    assert broken == [(backend_alias, name, held.token)]
    with pytest.raises(LockLost):
        held.ensure()
    assert backend.list(name) == []
    entry = LogEntry.objects.get(object_id=f"{backend_alias}:{name}")
    assert entry.action_flag == DELETION
    assert entry.object_repr == name
    assert entry.user.username == "admin"
    assert f"fencing token {held.token}" in entry.change_message


# --- who may see and break -----------------------------------------------------------------


@pytest.fixture
def held_lock(name: str) -> Iterator[HeldLock]:
    """A lease on the locmem backend, which a test may break."""
    with override_settings(DLOCK_BACKENDS=LOCMEM):
        held = lock(name).acquire()
        yield held
        with contextlib.suppress(LockNotOwned):
            held.release()


def break_form(held: Any, **extra: str) -> dict[str, str]:
    return {"backend": "default", "lock": lock_id(held.name), "token": str(held.token), **extra}


@pytest.mark.django_db
def test_anonymous_is_sent_to_the_login_page(held_lock: Any, client: Client) -> None:
    page = client.get(reverse(CHANGELIST))
    assert page.status_code == 302
    assert page["Location"].startswith(reverse("admin:login"))
    post = client.post(reverse(BREAK), break_form(held_lock, confirm="yes"))
    assert post.status_code == 302
    assert post["Location"].startswith(reverse("admin:login"))
    held_lock.ensure()


@pytest.mark.django_db
def test_staff_without_the_permissions_is_refused(held_lock: Any, django_user_model: Any) -> None:
    client = client_for(user_with(django_user_model))
    assert client.get(reverse(CHANGELIST)).status_code == 403
    assert client.post(reverse(BREAK), break_form(held_lock, confirm="yes")).status_code == 403
    index = client.get(reverse("admin:index"))
    assert reverse(CHANGELIST) not in index.content.decode()
    held_lock.ensure()


@pytest.mark.django_db
def test_view_permission_lists_but_cannot_break(held_lock: Any, django_user_model: Any) -> None:
    client = client_for(user_with(django_user_model, "view_lock"))
    index = client.get(reverse("admin:index"))
    assert reverse(CHANGELIST) in index.content.decode()
    page = client.get(reverse(CHANGELIST))
    assert page.status_code == 200
    assert [r["name"] for r in rows(page)] == [held_lock.name]
    assert "Break…" not in page.content.decode()
    assert client.post(reverse(BREAK), break_form(held_lock)).status_code == 403
    assert client.post(reverse(BREAK), break_form(held_lock, confirm="yes")).status_code == 403
    held_lock.ensure()


@pytest.mark.django_db
def test_break_permission_can_break(held_lock: Any, django_user_model: Any) -> None:
    client = client_for(user_with(django_user_model, "view_lock", "break_lock"))
    assert "Break…" in client.get(reverse(CHANGELIST)).content.decode()
    done = client.post(reverse(BREAK), break_form(held_lock, confirm="yes"))
    assert done.status_code == 302
    with pytest.raises(LockLost):
        held_lock.ensure()


@pytest.mark.django_db
def test_break_by_get_is_refused(held_lock: Any, admin_client: Client) -> None:
    response = admin_client.get(reverse(BREAK), break_form(held_lock, confirm="yes"))
    assert response.status_code == 405
    held_lock.ensure()


@pytest.mark.django_db
def test_break_without_the_csrf_token_is_refused(
    held_lock: Any, django_user_model: Any, admin_user: Any
) -> None:
    client = client_for(admin_user, enforce_csrf_checks=True)
    response = client.post(reverse(BREAK), break_form(held_lock, confirm="yes"))
    assert response.status_code == 403
    assert "CSRF" in response.content.decode()
    held_lock.ensure()


@pytest.mark.django_db
def test_names_and_metadata_are_escaped(admin_client: Client) -> None:
    with override_settings(DLOCK_BACKENDS=LOCMEM):
        metadata = {"note": XSS, "task_name": XSS, "task_id": '"><img src=x>'}
        held = lock(XSS, metadata=metadata).acquire()
        page = admin_client.get(reverse(CHANGELIST)).content.decode()
        confirm = admin_client.post(reverse(BREAK), break_form(held)).content.decode()
        for body in (page, confirm):
            assert XSS not in body
            assert "<img src=x>" not in body
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
        done = admin_client.post(reverse(BREAK), break_form(held, confirm="yes"), follow=True)
        assert XSS not in done.content.decode()
        with pytest.raises(LockLost):
            held.ensure()


# --- breaking safely -----------------------------------------------------------------------


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
def test_a_lease_taken_again_since_the_page_was_shown_is_left_alone(
    name: str, admin_client: Client
) -> None:
    seen = lock(name).acquire()
    form = break_form(seen)
    assert admin_client.post(reverse(BREAK), form).status_code == 200
    seen.release()
    with lock(name) as successor:
        done = admin_client.post(reverse(BREAK), {**form, "confirm": "yes"}, follow=True)
        successor.ensure()
        assert "has been released or taken again since it was listed" in done.content.decode()
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
@pytest.mark.parametrize(
    "form",
    [{}, {"backend": "nope", "lock": "eA", "token": "1"}, {"backend": "default", "lock": "eA"}],
    ids=["empty", "unknown-backend", "no-token"],
)
def test_a_malformed_break_request_breaks_nothing(
    form: dict[str, str], admin_client: Client
) -> None:
    with lock("x") as held:
        response = admin_client.post(reverse(BREAK), {**form, "confirm": "yes"}, follow=True)
        held.ensure()
    assert "did not name a lock and its token" in response.content.decode()


# --- the list ------------------------------------------------------------------------------


@pytest.mark.django_db
@override_settings(
    DLOCK_BACKENDS={
        "default": LOCMEM["default"],
        "other": {**LOCMEM["default"], "KEY_PREFIX": "other"},
    }
)
def test_paging_search_and_backend_filter(name: str, admin_client: Client) -> None:
    held = [lock(f"{name}:{i:03d}").acquire() for i in range(150)]
    held += [lock(f"{name}:x", backend="other").acquire(), lock("zzz", backend="other").acquire()]
    try:
        url = reverse(CHANGELIST)
        first = admin_client.get(url, {"q": name})
        assert len(rows(first)) == 100
        assert "151 locks held" in first.content.decode()
        second = admin_client.get(url, {"q": name, "p": "2"})
        assert [r["name"] for r in rows(second)][-2:] == [f"{name}:149", f"{name}:x"]
        assert len(rows(second)) == 51
        other = admin_client.get(url, {"backend": "other"})
        assert [(r["backend"], r["name"]) for r in rows(other)] == [
            ("other", f"{name}:x"),
            ("other", "zzz"),
        ]
        searched = admin_client.get(url, {"q": f"{name}:00".upper()})
        assert len(rows(searched)) == 10  # case-insensitive substring
    finally:
        for h in held:
            h.release()


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
def test_auto_refresh(admin_client: Client) -> None:
    url = reverse(CHANGELIST)
    assert '<meta http-equiv="refresh" content="10">' in admin_client.get(url).content.decode()
    five = admin_client.get(url, {"refresh": "5"}).content.decode()
    assert '<meta http-equiv="refresh" content="5">' in five
    off = admin_client.get(url, {"refresh": "0"}).content.decode()
    assert 'http-equiv="refresh"' not in off
    odd = admin_client.get(url, {"refresh": "1; url=https://example.invalid"}).content.decode()
    assert '<meta http-equiv="refresh" content="10">' in odd


@pytest.mark.django_db
def test_a_backend_that_does_not_answer_is_shown_with_the_rest(
    name: str, admin_client: Client
) -> None:
    down = {
        "BACKEND": "django_dlock.backends.redis.RedisBackend",
        "LOCATION": f"redis://:hunter2@127.0.0.1:{free_port()}/0",
    }
    with override_settings(DLOCK_BACKENDS={**LOCMEM, "down": down}), lock(name):
        page = admin_client.get(reverse(CHANGELIST))
        body = page.content.decode()
    assert page.status_code == 200
    assert [r["name"] for r in rows(page)] == [name]
    assert "Backend down did not answer" in body
    assert "hunter2" not in body


@pytest.mark.django_db
def test_the_admin_log_shows_breaks(admin_client: Client, name: str) -> None:
    with override_settings(DLOCK_BACKENDS=LOCMEM):
        held = lock(name).acquire()
        admin_client.post(reverse(BREAK), break_form(held, confirm="yes"))
    index = admin_client.get(reverse("admin:index"))
    assert index.status_code == 200
    assert name in index.content.decode()  # "Recent actions"


def test_the_pages_are_under_the_models_name() -> None:
    assert reverse(CHANGELIST) == "/admin/django_dlock/locklisting/"
    assert reverse(BREAK) == "/admin/django_dlock/locklisting/break/"


@pytest.mark.django_db
def test_the_permissions_are_on_the_models_content_type() -> None:
    codenames = set(
        Permission.objects.filter(
            content_type__app_label="django_dlock", content_type__model="locklisting"
        ).values_list("codename", flat=True)
    )
    assert codenames == {"view_lock", "break_lock"}


# --- semaphores and read/write locks -------------------------------------------------------


@contextlib.contextmanager
def waiter(side: Lock) -> Iterator[None]:
    """A thread waiting for ``side`` (the backend records it), which takes it and
    lets it go once the test releases what blocks it."""
    backend = locks[side.backend]

    def waiting() -> int:
        return sum(i.waiting for i in backend.semaphores(side.name) if i.name == side.name)

    thread = threading.Thread(target=lambda: side.acquire(timeout=30).release())
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while waiting() == 0:
            assert time.monotonic() < deadline, "the waiter was never recorded"
            time.sleep(0.01)
        yield
    finally:
        thread.join(timeout=30)


def slot_form(held: HeldLock, kind: str = "semaphore", **extra: str) -> dict[str, str]:
    return {**break_form(held), "kind": kind, **extra}


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
def test_semaphores_and_rwlocks_are_listed_with_kind_limit_mode_and_counts(
    name: str, admin_client: Client
) -> None:
    mutex = lock(f"{name}:mutex").acquire()
    exports = [semaphore(f"{name}:exports", limit=3).acquire() for _ in range(2)]
    writer = rwlock(f"{name}:catalog").write().acquire()
    payload = park_payload("billing.tasks.call_api", [], {}, {}, 1, 2)
    locks["default"].do_park(f"{name}:api", "task-1", 1, payload)
    try:
        with waiter(rwlock(f"{name}:catalog").read()):
            page = admin_client.get(reverse(CHANGELIST), {"q": name})
            writer.release()
    finally:
        locks["default"].do_unpark(f"{name}:api", 10)
    for held in (mutex, *exports):
        held.release()

    body = html.unescape(page.content.decode())
    assert rows(page) == [
        {"backend": "default", "name": f"{name}:mutex", "token": str(mutex.token)}
    ]
    assert "1 lock held, 3 slots of semaphores and read/write locks" in body
    assert "Semaphores and read/write locks" in body
    me = f"{writer.holder['host']}:{writer.holder['pid']}"
    columns = ("name", "kind", "limit", "mode", "token", "holder", "waiting", "parked")
    listed = [tuple(r[column] for column in columns) for r in slot_rows(page)]
    assert listed == [
        (f"{name}:api", "semaphore", "-", "-", "-", "no holder now", "0", "1"),
        (f"{name}:catalog", "read/write lock", "-", "write", str(writer.token), me, "1", "0"),
        *(
            (f"{name}:exports", "semaphore", "3", "slot", str(h.token), me, "0", "0")
            for h in exports
        ),
    ]
    assert [r["mode"] for r in slot_rows(page)] == ["-", "write", "slot", "slot"]
    # A Break button for each holder's slot, none for the row with no holder.
    assert body.count('name="kind" value="semaphore"') == 2
    assert body.count('name="kind" value="rwlock"') == 1


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
def test_break_frees_only_the_chosen_slot(name: str, admin_client: Client) -> None:
    broken: list[tuple[str, str, int | None]] = []

    def on_broken(sender: Any, **kwargs: Any) -> None:
        broken.append((kwargs["backend"], kwargs["name"], kwargs["token"]))

    first, second, third = (semaphore(name, limit=3).acquire() for _ in range(3))
    filters = urlencode({"kind": "semaphore", "q": name})
    form = slot_form(second, filters=filters)
    confirm = admin_client.post(reverse(BREAK), form)
    assert confirm.status_code == 200
    text = html.unescape(re.sub(r"<[^>]+>", "", confirm.content.decode()))
    assert "Are you sure?" in text
    assert f"Free the slot of semaphore “{name}” held with token {second.token}" in text
    assert '<tr><th scope="row">Limit</th><td>3</td></tr>' in confirm.content.decode()
    assert "Yes, free it" in confirm.content.decode()
    second.ensure()  # the first POST only asks

    lock_broken.connect(on_broken)
    try:
        done = admin_client.post(reverse(BREAK), {**form, "confirm": "yes"}, follow=True)
    finally:
        lock_broken.disconnect(on_broken)
    assert done.redirect_chain == [(f"{reverse(CHANGELIST)}?{filters}", 302)]
    label = f"{second.holder['host']}:{second.holder['pid']}"
    assert (
        f"Freed the slot of semaphore {name!r} on default (token {second.token}, held by {label})."
        in html.unescape(done.content.decode())
    )
    assert [r["token"] for r in slot_rows(done)] == [str(first.token), str(third.token)]
    assert broken == [("default", name, second.token)]
    with pytest.raises(LockLost):
        second.ensure()
    first.ensure()
    third.ensure()
    entry = LogEntry.objects.get(object_id=f"default:{name}")
    assert entry.action_flag == DELETION
    assert entry.change_message == (
        f"Freed the slot of semaphore {name!r} on backend 'default' "
        f"(fencing token {second.token}, held by {label})."
    )
    with semaphore(name, limit=3, timeout=0) as newcomer:  # the freed slot is free
        assert newcomer.token > third.token
    first.release()
    third.release()


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
def test_break_a_reader_of_a_rwlock(name: str, admin_client: Client) -> None:
    readers = [rwlock(name).read().acquire() for _ in range(2)]
    form = slot_form(readers[0], kind="rwlock")
    confirm = html.unescape(
        re.sub(r"<[^>]+>", "", admin_client.post(reverse(BREAK), form).content.decode())
    )
    assert f"Free the read slot of read/write lock “{name}”" in confirm
    done = admin_client.post(reverse(BREAK), {**form, "confirm": "yes"}, follow=True)
    assert f"Freed the read slot of read/write lock {name!r}" in html.unescape(
        done.content.decode()
    )
    with pytest.raises(LockLost):
        readers[0].ensure()
    readers[1].ensure()
    readers[1].release()


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
def test_a_slot_released_since_the_page_was_shown_is_left_alone(
    name: str, admin_client: Client
) -> None:
    seen = semaphore(name, limit=2).acquire()
    form = slot_form(seen)
    assert admin_client.post(reverse(BREAK), form).status_code == 200
    seen.release()
    with semaphore(name, limit=2) as other, semaphore(name, limit=2) as another:
        done = admin_client.post(reverse(BREAK), {**form, "confirm": "yes"}, follow=True)
        other.ensure()
        another.ensure()
    assert "has been released or has expired since it was listed" in done.content.decode()
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
def test_a_break_form_without_kind_never_frees_a_slot(name: str, admin_client: Client) -> None:
    """A mutex's form (no ``kind``) names the mutex keyspace: a slot with its name is kept."""
    held = semaphore(name, limit=2).acquire()
    done = admin_client.post(reverse(BREAK), break_form(held, confirm="yes"), follow=True)
    assert "has been released or taken again" in done.content.decode()
    held.ensure()
    held.release()


@pytest.mark.django_db
@override_settings(DLOCK_BACKENDS=LOCMEM)
def test_filter_by_kind_and_search_cover_the_slots(name: str, admin_client: Client) -> None:
    held = [
        lock(f"{name}:m").acquire(),
        semaphore(f"{name}:s", limit=2).acquire(),
        rwlock(f"{name}:rw").read().acquire(),
        semaphore(f"other:{name}", limit=2).acquire(),
    ]
    try:
        url = reverse(CHANGELIST)

        def listed(**params: str) -> list[str]:
            page = admin_client.get(url, {"q": name, **params})
            return [r["name"] for r in rows(page)] + [r["name"] for r in slot_rows(page)]

        # The mutexes, then the slots, each by name.
        assert listed() == [f"{name}:m", f"other:{name}", f"{name}:rw", f"{name}:s"]
        assert listed(kind="mutex") == [f"{name}:m"]
        assert listed(kind="semaphore") == [f"other:{name}", f"{name}:s"]
        assert listed(kind="rwlock") == [f"{name}:rw"]
        assert listed(kind="nonsense") == listed()
        assert listed(q=f"other:{name}".upper()) == [f"other:{name}"]
        page = admin_client.get(url, {"kind": "semaphore", "q": name}).content.decode()
        assert "No locks held" not in page  # only slots on the page: no empty mutex table
        assert 'name="kind" value="semaphore"' in page  # the search keeps the kind
    finally:
        for h in held:
            h.release()


@pytest.mark.django_db
def test_view_permission_lists_slots_but_cannot_free_them(
    name: str, django_user_model: Any
) -> None:
    client = client_for(user_with(django_user_model, "view_lock"))
    with override_settings(DLOCK_BACKENDS=LOCMEM), semaphore(name, limit=2) as held:
        page = client.get(reverse(CHANGELIST), {"q": name})
        assert [r["token"] for r in slot_rows(page)] == [str(held.token)]
        assert "Break…" not in page.content.decode()
        assert client.post(reverse(BREAK), slot_form(held, confirm="yes")).status_code == 403
        held.ensure()


@pytest.mark.django_db
def test_semaphore_names_are_escaped(admin_client: Client) -> None:
    with override_settings(DLOCK_BACKENDS=LOCMEM):
        held = semaphore(XSS, limit=2, metadata={"note": XSS}).acquire()
        page = admin_client.get(reverse(CHANGELIST)).content.decode()
        confirm = admin_client.post(reverse(BREAK), slot_form(held)).content.decode()
        for body in (page, confirm):
            assert XSS not in body
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
        admin_client.post(reverse(BREAK), slot_form(held, confirm="yes"))
        with pytest.raises(LockLost):
            held.ensure()


@pytest.mark.with_default_db
def test_list_and_free_a_slot_on_every_backend(
    backend_alias: str, backend: BaseLockBackend, name: str, admin_client: Client
) -> None:
    if not backend.supports_semaphores:
        pytest.skip(f"backend {backend_alias!r} declares no supports_semaphores")
    held = [semaphore(name, limit=2, backend=backend_alias).acquire() for _ in range(2)]
    try:
        page = admin_client.get(reverse(CHANGELIST), {"backend": backend_alias, "q": name})
        assert [(r["backend"], r["kind"], r["limit"], r["token"]) for r in slot_rows(page)] == [
            (backend_alias, "semaphore", "2", str(h.token)) for h in held
        ]
        filters = urlencode({"backend": backend_alias, "q": name})
        form = {**slot_form(held[0], filters=filters), "backend": backend_alias, "confirm": "yes"}
        done = admin_client.post(reverse(BREAK), form, follow=True)
        assert f"Freed the slot of semaphore {name!r} on {backend_alias}" in html.unescape(
            done.content.decode()
        )
        with pytest.raises(LockLost):
            held[0].ensure()
        held[1].ensure()
    finally:
        held[1].release()
        with contextlib.suppress(LockLost):
            held[0].release()


@pytest.mark.django_db
@pytest.mark.parametrize("django_61", [False, True], ids=["before-6.1", "6.1"])
def test_the_pages_follow_the_admin_markup_of_the_running_django(
    held_lock: Any, admin_client: Client, monkeypatch: pytest.MonkeyPatch, django_61: bool
) -> None:
    """Django 6.1 made the breadcrumbs an <ol> and put a change list's filter inside
    .changelist-form-container: the old markup broke the page there (the filter under the
    table, the toolbar squeezed, the page wider than the window). Seen in a browser on 6.1.3;
    this checks the markup each version's CSS expects."""
    monkeypatch.setattr("django.VERSION", (6, 1, 0, "final", 0) if django_61 else (5, 2, 0))
    page = admin_client.get(reverse(CHANGELIST)).content.decode()
    confirm = admin_client.post(reverse(BREAK), break_form(held_lock)).content.decode()
    container = page.index('<div class="changelist-form-container">')
    filters = page.index('<nav id="changelist-filter"')
    form_end = page.index('<p class="paginator">')
    for html_page in (page, confirm):
        assert ('<ol class="breadcrumbs">' in html_page) == django_61
        assert ('<div class="breadcrumbs">' in html_page) != django_61
    # Inside the container, first (6.1), or after the list, its sibling (before).
    assert (container < filters < form_end) == django_61
    assert (filters > form_end) != django_61
    assert page.count('<nav id="changelist-filter"') == 1


@pytest.mark.django_db
@override_settings(TIME_ZONE="Asia/Tokyo")
def test_the_time_the_list_was_taken_is_said_in_utc(held_lock: Any, admin_client: Client) -> None:
    """The page says "at HH:MM:SS UTC": it printed the local time (TIME_ZONE) with that label."""
    from datetime import datetime, timedelta, timezone

    before = datetime.now(timezone.utc)
    page = admin_client.get(reverse(CHANGELIST)).content.decode()
    after = datetime.now(timezone.utc)
    [said] = re.findall(r" at (\d\d:\d\d:\d\d) UTC</span>", page)
    allowed = {
        (before + timedelta(seconds=s)).strftime("%H:%M:%S")
        for s in range(int((after - before).total_seconds()) + 2)
    }
    assert said in allowed, (said, sorted(allowed))
