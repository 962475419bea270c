"""Checks for django-health-check 4.x: one per lock backend, ``locks[alias].ping()``.

In the project's URLconf::

    from django.urls import path
    from health_check.views import HealthCheckView

    from django_dlock.contrib.health_check import lock_backend_checks

    urlpatterns = [
        path("health/", HealthCheckView.as_view(checks=[
            "health_check.checks.Database",
            *lock_backend_checks(),  # every alias in DLOCK_BACKENDS
        ])),
    ]

or ``(LockBackend, {"alias": "redis"})`` for one backend. A backend that does
not answer within ``timeout`` (5 s) fails its check, and the view answers
500 naming it: ``LockBackend(alias='redis'): Unavailable: ...``.

Why the ping runs on a thread of its own (``pings.ping_in_thread``), not on
the event loop's executor where django-health-check runs a synchronous check:
under WSGI the view runs inside ``asyncio.run()``, which on its way out waits
for every thread of that executor, so a ping stuck on a server that never
answers would hold the response for as long as it is stuck, whatever the
check's timeout. A ping thread is a daemon, and at most one runs per backend:
a probe that comes while the last ping still waits does not start another
one, it waits for that one (within its own ``timeout``).

Warnings (a Redlock master down, a watchdog's lag notes) are not reported:
django-health-check 4.8 answers 500 for a ``ServiceWarning`` as for an error,
and a backend that can lock must not fail the probe. ``manage.py locks
check`` shows them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from typing import Any

try:
    from health_check.base import HealthCheck
    from health_check.exceptions import ServiceUnavailable
except ImportError as e:  # pragma: no cover - tested in a process without the package
    raise ImportError(
        "django_dlock.contrib.health_check needs django-health-check 4.8 or later "
        "(pip install 'django-dlock[health]')."
    ) from e

from ..exceptions import DLockError, LockConfigurationError
from ..handler import locks
from ..pings import ping_in_thread

__all__ = ["LockBackend", "lock_backend_checks"]


@dataclasses.dataclass
class LockBackend(HealthCheck):
    """The lock backend ``alias`` answers a ping within ``timeout``.

    :param alias: an alias of ``DLOCK_BACKENDS``.
    :param timeout: how long the probe waits for the answer.
    """

    alias: str = "default"
    timeout: datetime.timedelta = dataclasses.field(
        default=datetime.timedelta(seconds=5), repr=False
    )

    async def run(self) -> None:
        try:
            backend = locks[self.alias]
        except LockConfigurationError as e:
            raise ServiceUnavailable(f"lock backend {self.alias!r} is misconfigured: {e}") from e
        future, started = ping_in_thread(backend)
        limit = self.timeout.total_seconds()
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), limit)
        except asyncio.TimeoutError:
            raise ServiceUnavailable(
                f"lock backend {self.alias!r} did not answer a ping within {limit:g} s "
                f"(the ping started {time.monotonic() - started:.1f} s ago)"
            ) from None
        except DLockError as e:
            raise ServiceUnavailable(f"lock backend {self.alias!r}: {e}") from e


def lock_backend_checks(**options: Any) -> list[tuple[type[LockBackend], dict[str, Any]]]:
    """One ``LockBackend`` check per alias of ``DLOCK_BACKENDS``, as ``HealthCheckView`` takes.

    Read when called (the URLconf's import); ``options`` (``timeout``) go to each.
    """
    return [(LockBackend, {**options, "alias": alias}) for alias in locks]
