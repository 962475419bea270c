"""``"django_dlock.contrib.prometheus"`` in ``INSTALLED_APPS`` turns the metrics on."""

from __future__ import annotations

from django.apps import AppConfig


class PrometheusConfig(AppConfig):
    name = "django_dlock.contrib.prometheus"
    label = "dlock_prometheus"
    verbose_name = "django-dlock Prometheus metrics"

    def ready(self) -> None:
        from . import install

        install()
