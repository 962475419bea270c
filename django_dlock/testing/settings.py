"""Django settings for ``python -m django_dlock.testing``: the backend under test, from env.

``DLOCK_TEST_BACKEND`` (a dotted class), ``DLOCK_TEST_LOCATION`` (a string,
or JSON for a list) and ``DLOCK_TEST_OPTIONS`` (JSON) make the backend's
``DLOCK_BACKENDS`` entry, as ``"under_test"`` and as ``"default"``.
``DLOCK_TEST_DATABASE`` (JSON), if set, is the "default" ``DATABASES``
entry, and the tests of the backend under test get access to it (a backend
that keeps its leases in Django's database); else ``DLOCK_TEST_TMP`` is the
directory of a SQLite database that only the tests that need one use. The runner sets
them for its own process, its pytest-xdist workers and the processes the
tests start; without ``DLOCK_TEST_BACKEND`` nothing is under test.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

SECRET_KEY = "django-dlock conformance suite"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_dlock",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
_TMP = os.environ.get("DLOCK_TEST_TMP") or tempfile.gettempdir()
_DATABASE = os.environ.get("DLOCK_TEST_DATABASE")


def given_database(text: str) -> dict[str, Any]:
    """The ``DATABASES`` entry given as ``--database``.

    On SQLite, its test database is a file unless the entry names one:
    Django's default, a shared in-memory database, cannot be opened by the
    processes the multi-process tests start.
    """
    entry: dict[str, Any] = json.loads(text)
    if entry.get("ENGINE", "").endswith("sqlite3"):
        test = dict(entry.get("TEST") or {})
        test.setdefault("NAME", os.path.join(_TMP, "test_under_test.sqlite3"))
        entry["TEST"] = test
    return entry


DATABASES = {
    "default": given_database(_DATABASE)
    if _DATABASE
    else {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(_TMP, "dlock.sqlite3"),
        "TEST": {"NAME": os.path.join(_TMP, "test_dlock.sqlite3")},
        "OPTIONS": {"timeout": 30},
    },
}


def backend_entry() -> dict[str, Any] | None:
    """The ``DLOCK_BACKENDS`` entry of the backend under test, or None."""
    dotted = os.environ.get("DLOCK_TEST_BACKEND")
    if not dotted:
        return None
    entry: dict[str, Any] = {"BACKEND": dotted}
    location = os.environ.get("DLOCK_TEST_LOCATION")
    if location:
        entry["LOCATION"] = json.loads(location) if location.startswith("[") else location
    options = os.environ.get("DLOCK_TEST_OPTIONS")
    if options:
        entry["OPTIONS"] = json.loads(options)
    return entry


_ENTRY = backend_entry()
DLOCK_BACKENDS: dict[str, dict[str, Any]] = (
    {"default": _ENTRY, "under_test": _ENTRY} if _ENTRY else {}
)
#: alias -> the DATABASES alias its tests need (plugin.py): the backend under test needs none.
CONFORMANCE_BACKENDS: dict[str, str | None] = (
    {"under_test": "default" if _DATABASE else None} if _ENTRY else {}
)
