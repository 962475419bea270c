"""The Celery app that benchmarks/celery_dedup.py measures, in the benchmark and its worker.

Django is configured here (not from a settings module) with the Redis lock
backend on the benchmark's own redis-server, whose URL comes from the
environment; celery-singleton and celery-once use the same server.
"""

from __future__ import annotations

import os

import django
from django.conf import settings

REDIS = os.environ["DLOCK_BENCH_REDIS"]  # redis://127.0.0.1:PORT

if not settings.configured:
    settings.configure(
        INSTALLED_APPS=["django_dlock"],
        DLOCK_BACKENDS={
            "default": {
                "BACKEND": "django_dlock.backends.redis.RedisBackend",
                "LOCATION": f"{REDIS}/0",
            }
        },
        USE_TZ=True,
    )
    django.setup()

from celery import Celery  # noqa: E402
from celery_once import QueueOnce  # noqa: E402
from celery_singleton import Singleton  # noqa: E402

from django_dlock.celery import LockedTask  # noqa: E402

app = Celery("bench", broker=f"{REDIS}/1", backend=f"{REDIS}/2")
app.conf.update(
    task_serializer="json",
    worker_hijack_root_logger=False,
    singleton_backend_url=f"{REDIS}/3",
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": f"{REDIS}/4", "default_timeout": 60},
    },
)


@app.task
def plain(n: int) -> int:
    return n


@app.task(base=LockedTask, lock={"key": "bench:{n}", "ttl": 60})
def ours_run(n: int) -> int:
    return n


@app.task(base=LockedTask, lock={"key": "bench-q:{n}", "ttl": 60, "scope": "queue"})
def ours_queue(n: int) -> int:
    return n


@app.task(base=Singleton, lock_expiry=60)
def singleton(n: int) -> int:
    return n


@app.task(base=QueueOnce, once={"graceful": True})
def once(n: int) -> int:
    return n


# --- benchmarks/celery_defer.py: at most 2 bodies per key at once -------------------------

_INSIDE = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


def _limited_body(key: str, hold: float) -> int:
    """Count the bodies inside at once, on the benchmark's redis-server (db 5)."""
    import time

    import redis

    conn = redis.Redis.from_url(f"{REDIS}/5")
    inside = int(conn.eval(_INSIDE, 2, f"inside:{key}", f"most:{key}"))
    try:
        time.sleep(hold)
    finally:
        conn.decr(f"inside:{key}")
    return inside


@app.task(base=LockedTask, lock={"key": "defer:{key}", "ttl": 60, "limit": 2,
                                 "on_locked": "defer"})  # fmt: skip
def limited_defer(key: str, n: int, hold: float) -> int:
    return _limited_body(key, hold)


# How a limit is glued on without parking: retry every 50 ms until a slot is free.
@app.task(base=LockedTask, bind=True, max_retries=None,
          lock={"key": "retry:{key}", "ttl": 60, "limit": 2, "on_locked": "retry",
                "countdown": 0.05})  # fmt: skip
def limited_retry(self: object, key: str, n: int, hold: float) -> int:
    return _limited_body(key, hold)
