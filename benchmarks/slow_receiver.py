"""Issue 28 #3: a slow ``lock_lost`` receiver and another backend's lease.

    PYTHONPATH=.:testproject .venv/bin/python benchmarks/slow_receiver.py

Starts two redis-servers. Lease A (ttl 3) is on the first, lease B (ttl 3)
on the second; the first is stopped (SIGSTOP: it accepts and never answers)
and A's ``lock_lost`` receiver sleeps 6 s. For 6 s another client tries to
take B every 0.1 s; then B is broken (if nobody took it), and the script
prints whether B was taken and how long after that its ``lock_lost`` came.
Before the fix the receiver ran on the watchdog thread: B was taken and its
``lock_lost`` came about 4 s after. Now B is kept and its loss is reported
within a third of its TTL of the break.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"


def main() -> None:
    import django

    django.setup()
    from django.test import override_settings

    from django_dlock import LockTimeout, lock, locks
    from django_dlock.signals import lock_lost
    from tests.servers import RedisServer, free_port

    first, second = RedisServer(free_port()).start(), RedisServer(free_port()).start()
    redis = "django_dlock.backends.redis.RedisBackend"
    backends = {
        "default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"},
        "a": {"BACKEND": redis, "LOCATION": first.url, "OPTIONS": {"socket_timeout": 20}},
        "b": {"BACKEND": redis, "LOCATION": second.url},
    }
    lost_at: dict[str, float] = {}

    def on_lost(sender: Any, name: str, **kwargs: Any) -> None:
        lost_at.setdefault(name, time.monotonic())
        if name == "A":
            time.sleep(6)

    assert first.process is not None
    try:
        with override_settings(DLOCK_BACKENDS=backends):
            lock_lost.connect(on_lost, weak=False)
            held = [lock(n, backend=n.lower(), ttl=3).acquire() for n in "AB"]
            os.kill(first.process.pid, signal.SIGSTOP)
            taken = False
            until = time.monotonic() + 6
            while not taken and time.monotonic() < until:
                try:
                    locks["b"].acquire("B", timeout=0).release()
                    taken = True
                except LockTimeout:
                    time.sleep(0.1)
            ended = time.monotonic()
            if not taken:
                locks["b"].break_lock("B")
            while "B" not in lost_at and time.monotonic() < ended + 15:
                time.sleep(0.01)
            late = lost_at.get("B", float("nan")) - ended
            print(
                f"B taken by another client while A's receiver ran: {taken}; B's lock_lost "
                f"{late:.2f} s after {'it was taken' if taken else 'the break'} (ttl 3)"
            )
            del held
    finally:
        os.kill(first.process.pid, signal.SIGCONT)
        first.cleanup()
        second.cleanup()


if __name__ == "__main__":
    main()
