"""URLs for tests/test_health_check.py: django-health-check's view over every lock backend.

``urlpatterns`` is made when Django first resolves a URL after
``ROOT_URLCONF`` names this module (PEP 562 module ``__getattr__``), so
``lock_backend_checks()`` reads the test's own ``DLOCK_BACKENDS``, as a
project's URLconf reads its settings when it is imported.
"""

from __future__ import annotations

import datetime
from typing import Any

from django.urls import path
from health_check.views import HealthCheckView

from django_dlock.contrib.health_check import lock_backend_checks

#: The checks' bound in these tests; the default is 5 s.
TIMEOUT = datetime.timedelta(seconds=3)


def __getattr__(name: str) -> Any:
    if name != "urlpatterns":
        raise AttributeError(name)
    checks = lock_backend_checks(timeout=TIMEOUT)
    return [path("health/", HealthCheckView.as_view(checks=checks))]
