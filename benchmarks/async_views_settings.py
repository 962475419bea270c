"""Settings (and URLs) of the uvicorn app that benchmarks/async_handover.py measures.

The test suite's settings (every backend alias, on the servers the benchmark
started: their ports come in the environment, as for the tests' Celery
workers), pointed at the databases the benchmark created
(``DLOCK_BENCH_DATABASES``: alias -> database name). One async view per lock
backend, guarded by ``@lock_view`` with a timeout: a request waits for the
lock, holds it ``DLOCK_BENCH_HOLD`` seconds and answers 200.
"""

import asyncio
import json
import os

from django.http import HttpRequest, HttpResponse
from django.urls import path

from django_dlock.views import lock_view
from tests.settings import *  # noqa: F403
from tests.settings import DATABASES, DLOCK_BACKENDS

for _alias, _name in json.loads(os.environ.get("DLOCK_BENCH_DATABASES", "{}")).items():
    DATABASES[_alias]["NAME"] = _name

ROOT_URLCONF = "benchmarks.async_views_settings"
DEBUG = False
ALLOWED_HOSTS = ["*"]
HOLD = float(os.environ.get("DLOCK_BENCH_HOLD", "0.01"))


def _view(alias: str):  # type: ignore[no-untyped-def]
    @lock_view("bench:view", backend=alias, timeout=60, ttl=5)
    async def hold(request: HttpRequest) -> HttpResponse:
        await asyncio.sleep(HOLD)
        return HttpResponse("ok")

    return hold


urlpatterns = [path(f"hold/{alias}/", _view(alias)) for alias in DLOCK_BACKENDS]
