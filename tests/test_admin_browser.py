"""The admin's Locks page in a real browser: headless Debian Chromium, driven by Playwright.

The test project runs under ``runserver`` on its own SQLite file, another
process holds locks on the default (database) backend, and the browser logs
in, finds the lock, breaks it through the confirmation page and sees it gone;
the holder's ``held.ensure()`` then raises ``LockLost``.

With ``DLOCK_SCREENSHOT_DIR`` set, the screenshots also go there
(``make screenshots`` writes the ones in docs/img/).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.servers import free_port, port_open, wait_for

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
PASSWORD = "correct horse battery staple"


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install playwright)"
    if not os.access(CHROMIUM, os.X_OK):
        return f"Chromium is not installed at {CHROMIUM} (apt: chromium)"
    return None


if _missing():
    if settings.REQUIRE_ALL:
        raise RuntimeError(f"DLOCK_REQUIRE_ALL_BACKENDS=1 but: {_missing()}")
    pytestmark = pytest.mark.skip(reason=str(_missing()))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The test project on its own SQLite file, served by runserver, with a superuser."""
    data = tmp_path_factory.mktemp("admin-site")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "testproject")]),
        "DLOCK_DEMO_DB": str(data / "db.sqlite3"),
        "DLOCK_CELERY_DATA": str(data / "celery"),
        "DJANGO_SUPERUSER_USERNAME": "admin",
        "DJANGO_SUPERUSER_EMAIL": "admin@example.com",
        "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
    }
    manage = [sys.executable, str(ROOT / "testproject" / "manage.py")]
    for command in (["migrate", "--noinput", "-v0"], ["createsuperuser", "--noinput"]):
        subprocess.run([*manage, *command], env=env, check=True, capture_output=True, timeout=120)
    port = free_port()
    log = open(data / "runserver.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [*manage, "runserver", f"127.0.0.1:{port}", "--noreload"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: port_open("127.0.0.1", port), 60, f"runserver (log: {log.name})")
        yield {"url": f"http://127.0.0.1:{port}", "env": env, "data": data}
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


@pytest.fixture
def holder(site: dict[str, Any]) -> Iterator[Any]:
    """Another process holding three locks on the test project's database backend."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "admin_holder.py"),
            "report:daily",
            "invoice:42",
            "sync:account:7",
        ],
        env=site["env"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    proc.tokens = {}  # type: ignore[attr-defined]
    for _ in range(3):
        line = json.loads(proc.stdout.readline())
        proc.tokens[line["name"]] = line["token"]  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def _screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    target = os.environ.get("DLOCK_SCREENSHOT_DIR")
    if target:
        shutil.copy(path, Path(target) / name)
    return path


def _log_in(page: Any, url: str) -> None:
    page.goto(f"{url}/admin/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.get_by_role("link", name="Locks", exact=True).click()


def _shown(page: Any, selector: str) -> bool:
    """Whether the element is what the page shows at its centre: not scrolled out of its
    box nor covered (a button past a table's horizontal scrollbar is not)."""
    return bool(
        page.evaluate(
            """(selector) => {
                const el = document.querySelector(selector);
                const box = el.getBoundingClientRect();
                const x = box.left + box.width / 2, y = box.top + box.height / 2;
                if (x < 0 || x > window.innerWidth) return false;
                const results = el.closest(".results").getBoundingClientRect();
                if (box.left < results.left || box.right > results.right) return false;
                return document.elementFromPoint(x, y) === el;
            }""",
            selector,
        )
    )


def test_the_break_button_is_in_view_at_1280_px_with_the_nav_sidebar_open(
    site: dict[str, Any], holder: Any, tmp_path: Path
) -> None:
    """A long holder (a task's name and id) made the table wider than the page: the Break
    button sat behind the table's horizontal scrollbar, out of view."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            _log_in(page, site["url"])
            expect(page.locator("#nav-sidebar")).to_be_visible()
            button = 'tr.lock[data-name="sync:account:7"] td.field-break input.button'
            _screenshot(page, tmp_path, "admin-locks-1280.png")
            assert _shown(page, button)
        finally:
            browser.close()


def test_break_a_lock_held_by_another_process_in_the_browser(
    site: dict[str, Any], holder: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    token = holder.tokens["report:daily"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 560})
            _log_in(page, site["url"])
            expect(page.locator("#content h1")).to_have_text("Locks")

            row = page.locator('tr.lock[data-name="report:daily"]')
            expect(row.locator("td.field-token")).to_have_text(str(token))
            expect(row.locator("td.field-holder summary")).to_contain_text(f":{holder.pid}")
            task_row = page.locator('tr.lock[data-name="sync:account:7"]')
            expect(task_row.locator("td.field-holder summary")).to_contain_text(
                "billing.tasks.sync_account[5f0c1a2e-9b3d-4c7e-8a61-2f4d5e6a7b8c]"
            )
            row.locator("td.field-holder summary").click()  # the holder's metadata
            expect(row.locator("dl.holder")).to_contain_text("nightly sales report")
            assert _screenshot(page, tmp_path, "admin-locks.png").stat().st_size > 0

            row.get_by_role("button", name="Break…").click()
            expect(page.locator("#content h1")).to_have_text("Are you sure?")
            expect(page.locator(".lock-name")).to_have_text("report:daily")
            expect(page.locator("#lock-summary")).to_contain_text(str(token))
            _screenshot(page, tmp_path, "admin-break-confirmation.png")
            holder.stdin.write("ensure report:daily\n")
            holder.stdin.flush()
            assert holder.stdout.readline() == "held\n"  # asking is not breaking

            page.get_by_role("button", name="Yes, break it").click()
            expect(page.locator("ul.messagelist li.success")).to_contain_text(
                f"Broke the lease on 'report:daily' on default (token {token}"
            )
            expect(page.locator('tr.lock[data-name="report:daily"]')).to_have_count(0)
            expect(page.locator('tr.lock[data-name="invoice:42"]')).to_have_count(1)
            _screenshot(page, tmp_path, "admin-after-break.png")
        finally:
            browser.close()

    holder.stdin.write("ensure report:daily\n")
    holder.stdin.flush()
    assert holder.stdout.readline().startswith("LockLost: ")
    holder.stdin.write("ensure invoice:42\n")
    holder.stdin.flush()
    assert holder.stdout.readline() == "held\n"
