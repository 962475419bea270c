"""``manage.py locks`` and the admin's Locks page with a newcomer's settings.

The locks are on the zero-config database backend, taken inside the test's
transaction (TestCase), as a newcomer's own tests would take them.
"""

from __future__ import annotations

import json
from io import StringIO

from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.test import TestCase
from django.urls import reverse

from django_dlock import LockLost, lock
from django_dlock.admin import lock_id


def locks_command(*args: str) -> str:
    out = StringIO()
    call_command("locks", *args, stdout=out)
    return out.getvalue()


class CommandTests(TestCase):
    def test_list_show_break_check(self) -> None:
        held = lock("report:daily", metadata={"note": "nightly"}).acquire()
        self.assertIn(f"default  report:daily  {held.token}", locks_command())
        (item,) = json.loads(locks_command("--json"))
        self.assertEqual((item["name"], item["token"]), ("report:daily", held.token))
        self.assertIn("holder.note         nightly", locks_command("show", "report:daily"))
        self.assertIn("Broke 'report:daily'", locks_command("break", "report:daily", "--yes"))
        with self.assertRaises(LockLost):
            held.ensure()
        with self.assertRaises(CommandError) as caught:
            locks_command("show", "report:daily")
        self.assertEqual(caught.exception.returncode, 1)
        self.assertIn("SQLite", locks_command("check"))


class AdminTests(TestCase):
    def test_the_locks_page_lists_and_breaks(self) -> None:
        admin = User.objects.create_superuser("boss", "boss@example.com", "pw")
        self.client.force_login(admin)
        held = lock("<b>invoice:42</b>").acquire()
        index = self.client.get(reverse("admin:index"))
        self.assertContains(index, reverse("admin:django_dlock_locklisting_changelist"))
        page = self.client.get(reverse("admin:django_dlock_locklisting_changelist"))
        self.assertContains(page, "&lt;b&gt;invoice:42&lt;/b&gt;")
        self.assertNotContains(page, "<b>invoice:42</b>")
        form = {"backend": "default", "lock": lock_id(held.name), "token": str(held.token)}
        self.assertContains(
            self.client.post(reverse("admin:django_dlock_locklisting_break"), form),
            "Yes, break it",
        )
        done = self.client.post(
            reverse("admin:django_dlock_locklisting_break"), {**form, "confirm": "yes"}
        )
        self.assertRedirects(done, reverse("admin:django_dlock_locklisting_changelist"))
        with self.assertRaises(LockLost):
            held.ensure()
        self.assertEqual(LogEntry.objects.get().object_repr, "<b>invoice:42</b>")

    def test_the_permissions_exist_and_guard_the_page(self) -> None:
        codenames = set(
            Permission.objects.filter(
                content_type__app_label="django_dlock", content_type__model="locklisting"
            ).values_list("codename", flat=True)
        )
        self.assertEqual(codenames, {"view_lock", "break_lock"})
        staff = User.objects.create_user("staff", password="pw", is_staff=True)
        self.client.force_login(staff)
        url = reverse("admin:django_dlock_locklisting_changelist")
        self.assertEqual(self.client.get(url).status_code, 403)
        staff.user_permissions.add(Permission.objects.get(codename="view_lock"))
        self.assertEqual(self.client.get(url).status_code, 200)
