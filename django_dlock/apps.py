from __future__ import annotations

from django.apps import AppConfig


class DLockConfig(AppConfig):
    name = "django_dlock"
    verbose_name = "Distributed locks"

    def ready(self) -> None:
        from . import checks, signals  # noqa: F401  (registers the check and receivers)
