"""Settings as a production project has them, switched by environment variables.

- ``REALPROJ_DB`` / ``REALPROJ_LEDGER_DB``: the PostgreSQL databases of the
  "default" and "ledger" aliases (``REALPROJ_PG_HOST``/``_PORT``/``_USER``).
- ``REALPROJ_ATOMIC_REQUESTS``: "1" (default) or "0", for both databases.
- ``REALPROJ_LOCK_BACKEND``: "db" (the database backend; default) or "redis"
  (``REALPROJ_REDIS_URL``).
- ``REALPROJ_CONN_MAX_AGE``: 60 by default; the load script serves the views
  (uvicorn) with 0, as Django's docs say to under ASGI ("When using ASGI,
  persistent connections should be disabled": each request runs in a thread
  of its own, whose connection nothing reuses), and runs the Celery worker
  with 60.
- ``REALPROJ_APP_NAME``: PostgreSQL's application_name for this process's
  connections, so the load script can count them by role.
- ``CELERY_BROKER_URL`` (RabbitMQ on 127.0.0.1 by default) and ``REALPROJ_QUEUE``.
"""

import os
from pathlib import Path

from kombu import Queue

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "realproject-only-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django_dlock",
    "inventory",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
]

ROOT_URLCONF = "realproject.urls"
ASGI_APPLICATION = "realproject.asgi.application"

ATOMIC_REQUESTS = os.environ.get("REALPROJ_ATOMIC_REQUESTS", "1") == "1"


def _postgresql(name: str) -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": os.environ.get("REALPROJ_PG_HOST", "127.0.0.1"),
        "PORT": os.environ.get("REALPROJ_PG_PORT", "5432"),
        "USER": os.environ.get("REALPROJ_PG_USER", "postgres"),
        "PASSWORD": os.environ.get("REALPROJ_PG_PASSWORD", ""),
        "NAME": name,
        "ATOMIC_REQUESTS": ATOMIC_REQUESTS,
        "CONN_MAX_AGE": int(os.environ.get("REALPROJ_CONN_MAX_AGE", "60")),
        "CONN_HEALTH_CHECKS": True,
        "OPTIONS": {"application_name": os.environ.get("REALPROJ_APP_NAME", "realproj")},
    }


DATABASES = {
    "default": _postgresql(os.environ.get("REALPROJ_DB", "realproj")),
    "ledger": _postgresql(os.environ.get("REALPROJ_LEDGER_DB", "realproj_ledger")),
}
DATABASE_ROUTERS = ["realproject.routers.LedgerRouter"]

LOCK_BACKEND = os.environ.get("REALPROJ_LOCK_BACKEND", "db")
if LOCK_BACKEND == "redis":
    _redis = {
        "BACKEND": "django_dlock.backends.redis.RedisBackend",
        "LOCATION": os.environ.get("REALPROJ_REDIS_URL", "redis://127.0.0.1:6379/0"),
        "KEY_PREFIX": "realproj",
    }
    DLOCK_BACKENDS = {"default": _redis, "ledger": _redis}
    # A Redis lock does not know which database's transaction to wait for.
    LEDGER_LOCK_USING: str | None = "ledger"
elif LOCK_BACKEND == "db":
    DLOCK_BACKENDS = {
        "default": {"BACKEND": "django_dlock.backends.database.DatabaseBackend"},
        "ledger": {
            "BACKEND": "django_dlock.backends.database.DatabaseBackend",
            "OPTIONS": {"database": "ledger"},
        },
    }
    # The database backend's own database is the transaction to wait for.
    LEDGER_LOCK_USING = None
else:
    raise ValueError(f"REALPROJ_LOCK_BACKEND must be 'db' or 'redis', not {LOCK_BACKEND!r}")

#: How long a guarded view waits for its lock before answering 423. 30 s: the
#: suite runs this load beside other tests (pytest-xdist), and at a load average
#: of 30 one request of 42 once waited more than 10 s on the database backend.
VIEW_LOCK_TIMEOUT = float(os.environ.get("REALPROJ_VIEW_LOCK_TIMEOUT", "30"))

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("REALPROJ_QUEUE", "realproj")
CELERY_TASK_QUEUES = [Queue(CELERY_TASK_DEFAULT_QUEUE, auto_delete=True)]
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "Europe/Paris"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django.request": {"handlers": ["console"], "level": "ERROR"}},
}
