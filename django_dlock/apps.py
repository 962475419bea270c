from __future__ import annotations

from django.apps import AppConfig


class DLockConfig(AppConfig):
    name = "django_dlock"
    verbose_name = "Distributed locks"
    # Fixed here, so that a project's DEFAULT_AUTO_FIELD never asks for a migration.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks, handler  # noqa: F401  (registers the checks and the receiver)
