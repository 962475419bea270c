"""Check django_dlock.W004: a ``LockedSaveMixin`` model in an admin that lets a held lock be a 500.

Issue 27: registered with a plain ``ModelAdmin`` (what a newcomer writes), a
``LockedSaveMixin`` model's change form answered 500 (``LockTimeout``) when the
instance's lock was held, and nothing said to use ``LockedModelAdmin``. Each
test registers on an AdminSite of its own, unregistered at the end, so no
other test's ``manage.py check`` sees it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth.models import User
from django.core import checks
from django.db import connection, models
from django.test import Client
from django.test.utils import isolate_apps
from django.urls import path

from django_dlock import LockTimeout
from django_dlock.admin import LockedModelAdmin, LockedModelAdminMixin
from django_dlock.saves import LockedSaveMixin, instance_lock_name
from tests import views_atomic  # noqa: F401  (its admin site, registered right, is checked too)
from tests.models import Document, LockedDocument, LockedNote
from tests.test_fencing import held_by_another_thread


@pytest.fixture
def site() -> Iterator[admin.AdminSite]:
    """An admin site of the test's own; what it registers is gone after the test."""
    own = admin.AdminSite(name="own_admin")
    yield own
    for model in list(own._registry):
        own.unregister(model)


def serve(site: admin.AdminSite, settings: Any) -> None:
    """Make ``/admin/`` the site as registered now (its URLs are built from its registry)."""
    urlconf = types.ModuleType("own_admin_urls")
    urlconf.urlpatterns = [path("admin/", site.urls)]  # type: ignore[attr-defined]
    settings.ROOT_URLCONF = urlconf


def dlock_admin_warnings() -> list[checks.CheckMessage]:
    """What ``manage.py check`` reports from django_dlock's admin check, on every site."""
    return [
        message
        for message in checks.run_checks(tags=[checks.Tags.admin])
        if message.id and message.id.startswith("django_dlock.")
    ]


def test_a_plain_model_admin_of_a_locked_model_is_warned(site: admin.AdminSite) -> None:
    class DocumentAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
        pass

    site.register(LockedDocument)
    site.register(LockedNote, DocumentAdmin)
    site.register(Document)  # not a LockedSaveMixin model: nothing to say
    warnings = dlock_admin_warnings()
    assert [(w.id, w.level) for w in warnings] == [("django_dlock.W004", checks.WARNING)] * 2
    by_model = {w.msg.split()[0]: w for w in warnings}
    assert sorted(by_model) == ["tests.LockedDocument", "tests.LockedNote"]
    plain = by_model["tests.LockedDocument"]
    assert "admin site 'own_admin' with ModelAdmin" in plain.msg
    assert "server error (LockTimeout)" in plain.msg
    assert plain.hint is not None
    assert "django_dlock.admin.LockedModelAdmin" in plain.hint
    assert plain.obj is admin.ModelAdmin
    assert by_model["tests.LockedNote"].obj is DocumentAdmin
    assert "DocumentAdmin" in (by_model["tests.LockedNote"].hint or "")


def test_locked_model_admin_and_the_mixin_are_not_warned(site: admin.AdminSite) -> None:
    class NoteAdmin(LockedModelAdminMixin, admin.ModelAdmin):  # type: ignore[type-arg]
        pass

    site.register(LockedDocument, LockedModelAdmin)
    site.register(LockedNote, NoteAdmin)
    assert dlock_admin_warnings() == []


def test_an_admin_site_defined_in_the_urlconf_is_checked(
    tmp_path: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site that exists only once the URLconf is imported is checked all the same."""
    (tmp_path / "admin_check_urlconf.py").write_text(
        "from django.contrib import admin\n"
        "from django.urls import path\n"
        "from tests.models import LockedNote\n"
        "site = admin.AdminSite(name='urlconf_admin')\n"
        "site.register(LockedNote)\n"
        "urlpatterns = [path('admin/', site.urls)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "admin_check_urlconf", raising=False)
    settings.ROOT_URLCONF = "admin_check_urlconf"
    try:
        warnings = dlock_admin_warnings()
    finally:
        module = sys.modules.pop("admin_check_urlconf", None)
        if module is not None:
            module.site.unregister(LockedNote)
    assert [w.msg.split(" with ")[0] for w in warnings] == [
        "tests.LockedNote is a LockedSaveMixin model in admin site 'urlconf_admin'"
    ]


def test_the_check_keeps_to_the_apps_it_is_given(site: admin.AdminSite) -> None:
    from django_dlock.checks import check_locked_models_admin

    site.register(LockedDocument)
    assert list(check_locked_models_admin([apps.get_app_config("django_dlock")])) == []
    found = list(check_locked_models_admin([apps.get_app_config("tests")]))
    assert [w.id for w in found] == ["django_dlock.W004"]


@isolate_apps("tests")
def test_an_inline_of_a_locked_model_in_a_plain_admin_is_warned(site: admin.AdminSite) -> None:
    """The parent's change form saves the inline rows: a held lock is a 500 there too."""

    class Order(models.Model):
        def __str__(self) -> str:
            return f"order {self.pk}"

    class OrderLine(LockedSaveMixin, models.Model):
        order = models.ForeignKey(Order, on_delete=models.CASCADE)

        def __str__(self) -> str:
            return f"line {self.pk}"

    class Lines(admin.TabularInline):  # type: ignore[type-arg]
        model = OrderLine

    class OrderAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
        inlines = [Lines]

    class LockedOrderAdmin(LockedModelAdmin):
        inlines = [Lines]

    site.register(Order, OrderAdmin)
    warnings = dlock_admin_warnings()
    assert [w.id for w in warnings] == ["django_dlock.W004"]
    assert warnings[0].msg.startswith(
        "tests.OrderLine is a LockedSaveMixin model in admin site 'own_admin' as an inline of "
        "tests.Order with OrderAdmin"
    )
    assert warnings[0].obj is OrderAdmin
    site.unregister(Order)
    site.register(Order, LockedOrderAdmin)
    assert dlock_admin_warnings() == []


@pytest.mark.django_db(transaction=True)
def test_a_plain_model_admin_answers_500_when_the_lock_is_held(
    site: admin.AdminSite, admin_user: User, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pattern W004 warns of, as docs/admin.md shows it; LockedModelAdmin's refusal is
    tests/test_views_atomic.py::test_the_admin_refuses_a_save_whose_lock_is_held_with_a_message.
    """
    site.register(LockedDocument)
    serve(site, settings)
    monkeypatch.setattr(LockedDocument, "lock_timeout", 0)
    doc = LockedDocument.objects.create(title="original")
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)
    with held_by_another_thread(instance_lock_name(doc)):
        response = client.post(f"/admin/tests/lockeddocument/{doc.pk}/change/", {"title": "x"})
    assert response.status_code == 500
    assert isinstance(response.exc_info[1], LockTimeout)
    assert LockedDocument.objects.get(pk=doc.pk).title == "original"


@isolate_apps("tests")
@pytest.mark.django_db(transaction=True)
def test_an_inline_of_a_locked_model_is_a_500_in_a_plain_admin_and_refused_in_locked_model_admin(
    site: admin.AdminSite, admin_user: User, settings: Any
) -> None:
    """What the inline warning is about, with real tables: the parent's form saves the line."""

    class Order(models.Model):
        note = models.CharField(max_length=20, default="")

        def __str__(self) -> str:
            return f"order {self.pk}"

    class OrderLine(LockedSaveMixin, models.Model):
        lock_backend = "locmem"
        lock_timeout = 0
        order = models.ForeignKey(Order, on_delete=models.CASCADE)
        qty = models.IntegerField(default=1)

        def __str__(self) -> str:
            return f"line {self.pk}"

    class Lines(admin.TabularInline):  # type: ignore[type-arg]
        model = OrderLine
        extra = 0

    class OrderAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
        inlines = [Lines]

    class LockedOrderAdmin(LockedModelAdmin):
        inlines = [Lines]

    with connection.schema_editor() as editor:
        editor.create_model(Order)
        editor.create_model(OrderLine)
    try:
        order = Order.objects.create(note="original")
        line = OrderLine.objects.create(order=order)
        form = {
            "note": "edited",
            "orderline_set-TOTAL_FORMS": "1",
            "orderline_set-INITIAL_FORMS": "1",
            "orderline_set-MIN_NUM_FORMS": "0",
            "orderline_set-MAX_NUM_FORMS": "1000",
            "orderline_set-0-id": str(line.pk),
            "orderline_set-0-order": str(order.pk),
            "orderline_set-0-qty": "5",
        }
        client = Client(raise_request_exception=False)
        client.force_login(admin_user)
        change = f"/admin/tests/order/{order.pk}/change/"
        for admin_class, status in ((OrderAdmin, 500), (LockedOrderAdmin, 200)):
            site.register(Order, admin_class)
            serve(site, settings)
            with held_by_another_thread(instance_lock_name(line)):
                response = client.post(change, form)
            site.unregister(Order)
            assert response.status_code == status, admin_class
            assert isinstance(response.exc_info and response.exc_info[1], LockTimeout) == (
                status == 500
            )
            assert (Order.objects.get().note, OrderLine.objects.get().qty) == ("original", 1)
        assert "Not saved: this object is being changed elsewhere" in response.content.decode()
        site.register(Order, LockedOrderAdmin)
        serve(site, settings)
        assert client.post(change, form).status_code == 302  # the lock is free: saved
        assert (Order.objects.get().note, OrderLine.objects.get().qty) == ("edited", 5)
    finally:
        with connection.schema_editor() as editor:
            editor.delete_model(OrderLine)
            editor.delete_model(Order)
