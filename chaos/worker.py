"""One chaos worker process: lock, fenced claim-then-write on a register, release, again.

One hold in twenty lasts half to all of the TTL, so that the watchdog renews
them (at a third of the TTL) while the faults run; a lease the watchdog finds
lost is recorded with when it ended by the handle's clock.

Started by ``chaos/run.py`` (in a network namespace when the run has network
faults) with its configuration as JSON in ``DLOCK_CHAOS_CONFIG``. It records
every operation as one JSON line in its history file, written and flushed
before and after the call: ``{"w": worker, "op": ..., "inv": t0, "cmp": t1,
...}``. Times are ``time.monotonic()``, which on Linux is one clock for every
process on the machine (CLOCK_MONOTONIC), and is not moved by a wall-clock
jump.

The register is a row in PostgreSQL, reached on a link the nemesis leaves
alone. A holder with token T:

1. claims: ``UPDATE reg SET fence = T WHERE fence < T`` (refused: a newer
   token has claimed, so this holder's write would be stale);
2. reads the counter;
3. writes counter + 1 ``WHERE fence = T``, and logs (T, value) in the same
   transaction.

Claiming before reading makes the read-modify-write safe even when two
holders overlap (a paused holder whose lease ran out): the older one's write
no longer matches the fence. The checker (``chaos/history.py``) reads the
log: accepted writes must carry increasing tokens and consecutive values.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from typing import Any


def main() -> None:
    config = json.loads(os.environ["DLOCK_CHAOS_CONFIG"])
    if config.get("clock_offset_file"):
        _follow_clock_offset(config["clock_offset_file"])
    import django
    from django.conf import settings

    settings.configure(
        DATABASES=config["databases"],
        INSTALLED_APPS=["django_dlock"],
        DLOCK_BACKENDS={"default": config["backend"]},
        USE_TZ=True,
        LOGGING_CONFIG=None,
    )
    django.setup()
    if config.get("migrate"):
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        return
    import psycopg

    from django_dlock import BackendUnavailable, LockLost, LockTimeout, locks
    from django_dlock.signals import lock_lost

    worker = config["worker"]

    history = open(config["history"], "a", buffering=1)  # noqa: SIM115 - lives as long as we do
    writing = threading.Lock()

    def record(**fields: Any) -> None:
        with writing:  # the watchdog thread records lost leases
            history.write(json.dumps({"w": worker, **fields}) + "\n")

    def on_lost(sender: Any, token: int | None = None, held: Any = None, **kwargs: Any) -> None:
        # When the handle's lease ended by its own clock: from then on the
        # holder may not count on it (it finds out at ensure() or release).
        now = time.monotonic()
        until = now + min(0.0, held.expires_in) if held is not None else now
        record(op="lost", inv=now, token=token, until=until)

    lock_lost.connect(on_lost, weak=False)

    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    register = _Register(config["register"], config["table"], config["name"])
    backend = locks["default"]
    kind = config.get("kind", "mutex")
    # A semaphore of limit 1, or a read/write lock's write side: exclusive as
    # the mutex is, so the same checker applies.
    slot: dict[str, int] = {}
    if kind != "mutex":
        from django_dlock.backends.limits import RW_LIMIT

        slot = {"limit": 1, "weight": 1} if kind == "semaphore" else (
            {"limit": RW_LIMIT, "weight": RW_LIMIT})  # fmt: skip
    name = config["name"]
    rng = random.Random()
    record(op="start", inv=time.monotonic(), pid=os.getpid())
    while not stop:
        inv = time.monotonic()
        record(op="acquire", inv=inv)
        try:
            held = backend.acquire(name, ttl=config["ttl"], timeout=config["timeout"], **slot)
        except LockTimeout:
            record(op="acquire", inv=inv, cmp=time.monotonic(), ok=False, why="timeout")
            continue
        except BackendUnavailable as e:
            record(op="acquire", inv=inv, cmp=time.monotonic(), ok=False, why="unavailable",
                   error=str(e)[:200])  # fmt: skip
            time.sleep(0.1)
            continue
        except Exception as e:
            record(op="acquire", inv=inv, cmp=time.monotonic(), ok=False, why="error",
                   error=repr(e)[:300])  # fmt: skip
            time.sleep(0.1)
            continue
        token = held.token
        record(op="acquire", inv=inv, cmp=time.monotonic(), ok=True, token=token)
        # The nemesis pauses or kills the process that holds the lock.
        _write_atomic(config["holding"], f"{os.getpid()}\n")
        # Now and then a hold long enough for the watchdog to renew it (at a
        # third of the TTL), so that renewal meets the faults too.
        long = rng.random() < config["long_share"]
        time.sleep(rng.uniform(config["ttl"] / 2, config["ttl"]) if long else
                   rng.uniform(0, config["hold"]))  # fmt: skip
        inv = time.monotonic()
        record(op="write", inv=inv, token=token)
        try:
            if long:
                # A long holder asks first, as a careful one does: its lease
                # may have been lost (renewal cut off). A short one writes at
                # once, so that a pause lands between its check and its write
                # and the register's fencing is what refuses it.
                held.ensure()
            outcome, value = register.write(token)
        except LockLost:
            record(op="write", inv=inv, cmp=time.monotonic(), token=token, ok=None, why="lost")
        except BackendUnavailable:
            # ensure() could not ask: not a write the register saw.
            record(op="write", inv=inv, cmp=time.monotonic(), token=token, ok=None,
                   why="unavailable")  # fmt: skip
        except psycopg.Error as e:
            record(op="write", inv=inv, cmp=time.monotonic(), token=token, ok=None,
                   error=repr(e)[:200])  # fmt: skip
            register.reset()
        else:
            record(op="write", inv=inv, cmp=time.monotonic(), token=token,
                   ok=outcome == "ok", why=outcome, value=value)  # fmt: skip
        inv = time.monotonic()
        record(op="release", inv=inv, token=token)
        try:
            held.release()
        except LockLost as e:
            record(op="release", inv=inv, cmp=time.monotonic(), token=token, ok=False,
                   why="lost", error=str(e)[:200])  # fmt: skip
        except BackendUnavailable as e:
            record(op="release", inv=inv, cmp=time.monotonic(), token=token, ok=None,
                   why="unavailable", error=str(e)[:200])  # fmt: skip
        except Exception as e:
            record(op="release", inv=inv, cmp=time.monotonic(), token=token, ok=None,
                   why="error", error=repr(e)[:200])  # fmt: skip
        else:
            record(op="release", inv=inv, cmp=time.monotonic(), token=token, ok=True)
        time.sleep(rng.uniform(0, config["pause"]))
    record(op="stop", inv=time.monotonic())
    history.close()
    sys.exit(0)


class _Register:
    """The fenced register: a row of ``{table}_reg`` and the log ``{table}_log``."""

    def __init__(self, dsn: str, table: str, name: str) -> None:
        self.dsn = dsn
        self.table = table
        self.name = name
        self.conn: Any = None

    def reset(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.conn = None

    def write(self, token: int) -> tuple[str, int | None]:
        import psycopg

        if self.conn is None:
            self.conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
        t = self.table
        cur = self.conn.execute(
            f"UPDATE {t}_reg SET fence = %s WHERE name = %s AND fence < %s",
            (token, self.name, token),
        )
        if cur.rowcount != 1:
            return "stale-claim", None
        row = self.conn.execute(
            f"SELECT counter FROM {t}_reg WHERE name = %s",
            (self.name,),
        ).fetchone()
        value = row[0] + 1
        with self.conn.transaction():
            cur = self.conn.execute(
                f"UPDATE {t}_reg SET counter = %s WHERE name = %s AND fence = %s",
                (value, self.name, token),
            )
            if cur.rowcount != 1:
                return "stale-write", None
            self.conn.execute(
                f"INSERT INTO {t}_log (name, token, value) VALUES (%s, %s, %s)",
                (self.name, token, value),
            )
        return "ok", value


def _follow_clock_offset(path: str) -> None:
    """The ``clockstep`` fault: this process's wall clock is offset by ``path``'s seconds.

    SQLite keeps no clock: its leases end by the wall clock of the processes
    that use it, read with ``time.time_ns()``. A step of that clock is a step
    of the lock service's clock, as a step of the machine's clock would be;
    ``time.monotonic()`` is not moved. The file is read every 50 ms.
    """
    real_ns, offset = time.time_ns, [0]

    def follow() -> None:
        while True:  # a daemon thread: it ends with the worker
            with contextlib.suppress(OSError, ValueError), open(path) as f:
                offset[0] = int(float(f.read()) * 1e9)
            time.sleep(0.05)

    threading.Thread(target=follow, name="chaos-clock", daemon=True).start()
    time.time_ns = lambda: real_ns() + offset[0]
    time.time = lambda: (real_ns() + offset[0]) / 1e9


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
