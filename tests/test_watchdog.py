"""The watchdog: django_dlock.testing's suite on every backend, and a test of two of ours."""

from __future__ import annotations

import time
from typing import Any

import pytest

from django_dlock import lock
from django_dlock.signals import lock_lost
from django_dlock.testing.test_watchdog import *  # noqa: F403


@pytest.mark.django_db(transaction=True)
def test_a_blocked_backend_delays_no_other_backends_renewals(
    redis_servers: Any, name: str
) -> None:
    """Another process holds SQLite's write lock, so database renewals block.

    Issue 15: the one watchdog thread waited on SQLite while a healthy Redis
    lease in the same process ran out and another client took it, and no
    ``lock_lost`` fired for 6 s. Now the Redis lease is renewed all along, and
    the database lease is reported lost by the time it runs out.
    """
    import subprocess
    import sys

    from django.db import connections

    lost_at: dict[str, float] = {}

    def on_lost(sender: Any, name: str, **kwargs: Any) -> None:
        lost_at.setdefault(name, time.monotonic())

    lock_lost.connect(on_lost, weak=False, dispatch_uid="blocked-backend")
    db_held = lock(f"{name}:db", backend="db-sqlite", ttl=1).acquire()
    redis_held = lock(f"{name}:redis", backend="redis", ttl=1).acquire()
    blocker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "db = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE')\n"
            "print('locked', flush=True)\n"
            "time.sleep(4)\n"
            "db.execute('ROLLBACK')\n",
            str(connections["default"].settings_dict["NAME"]),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert blocker.stdout is not None
        assert blocker.stdout.readline().strip() == "locked"
        runs_out = time.monotonic() + db_held.expires_in  # no renewal gets through now
        time.sleep(3)
        assert not redis_held.lost, redis_held.lost_reason
        redis_held.ensure()  # renewed while the database was blocked
        assert db_held.lost
        # Reported by the time it ran out, not when the blocked call returned
        # (a watchdog that wakes up to 0.3 s late on a loaded machine is slack).
        assert lost_at[f"{name}:db"] <= runs_out + 0.3
    finally:
        blocker.wait(timeout=30)
        lock_lost.disconnect(dispatch_uid="blocked-backend")
    redis_held.release()
