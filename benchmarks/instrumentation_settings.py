"""Settings for benchmarks/instrumentation.py: locmem and one Redis lock backend, no database."""

import os

SECRET_KEY = "benchmark-only"
INSTALLED_APPS = ["django_dlock"]
DLOCK_BACKENDS = {
    "default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"},
    "locmem": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"},
    "redis": {
        "BACKEND": "django_dlock.backends.redis.RedisBackend",
        "LOCATION": os.environ["DLOCK_BENCH_REDIS_URL"],
    },
}
USE_TZ = True
