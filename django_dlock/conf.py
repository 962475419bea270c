"""Defaults and settings access.

Settings are never read at import time: ``backends_setting()`` reads them on
first use and ``signals.py`` clears the cache when a test overrides them.
"""

from __future__ import annotations

import functools
from typing import Any

from django.conf import settings

DEFAULT_ALIAS = "default"
#: Seconds a lease lasts unless renewed; DESIGN.md: "no infinite locks".
DEFAULT_TTL = 30.0
#: Used when ``DLOCK_BACKENDS`` is absent: the database backend on the "default" database.
DEFAULT_BACKENDS: dict[str, dict[str, Any]] = {
    DEFAULT_ALIAS: {"BACKEND": "django_dlock.backends.database.DatabaseBackend"},
}
#: Keys every backend accepts at the top level of its settings dict.
SETTINGS_KEYS = frozenset({"BACKEND", "LOCATION", "TTL", "KEY_PREFIX", "OPTIONS"})


@functools.cache
def backends_setting() -> Any:
    """``settings.DLOCK_BACKENDS`` as written, or None when it is absent."""
    return getattr(settings, "DLOCK_BACKENDS", None)


def clear_cache() -> None:
    backends_setting.cache_clear()
