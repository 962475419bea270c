"""Settings for benchmarks/async_waiters.py: a fair and an unfair Redis backend, no database."""

import os

SECRET_KEY = "benchmark-only"
INSTALLED_APPS = ["django_dlock"]
DLOCK_BACKENDS = {
    "default": {
        "BACKEND": "django_dlock.backends.redis.RedisBackend",
        "LOCATION": os.environ["DLOCK_BENCH_REDIS_URL"],
        "OPTIONS": {"fair": True},
    },
    "unfair": {
        "BACKEND": "django_dlock.backends.redis.RedisBackend",
        "LOCATION": os.environ["DLOCK_BENCH_REDIS_URL"],
    },
}
DLOCK_BACKENDS["fair"] = DLOCK_BACKENDS["default"]
USE_TZ = True
