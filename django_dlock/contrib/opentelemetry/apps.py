"""``"django_dlock.contrib.opentelemetry"`` in ``INSTALLED_APPS`` turns the spans on."""

from __future__ import annotations

from django.apps import AppConfig


class OpenTelemetryConfig(AppConfig):
    name = "django_dlock.contrib.opentelemetry"
    label = "dlock_opentelemetry"
    verbose_name = "django-dlock OpenTelemetry spans"

    def ready(self) -> None:
        from . import install

        install()
