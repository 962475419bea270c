"""100 async waiters on one lock, each holding it 10 ms, on every backend (issue 27, item 5).

    PYTHONPATH=.:testproject .venv/bin/python benchmarks/async_handover.py
    ... --waiters 30 --only locmem --only redis       # fewer, some backends
    ... --views                                        # also through uvicorn

Starts its own redis-server (one, a 3-master Cluster, 3 Redlock masters) and
etcd, and makes test databases on the machine's PostgreSQL and MariaDB (the
test suite's settings, tests/settings.py, with their aliases). For each lock
backend, in one process and a fresh event loop with the default executor as
Python makes it:

- a gate task takes the lock; N waiter tasks start and wait for it
  (``async with lock(..., ttl=2, timeout=60)``), each holding it ``--hold``
  seconds once inside; the gate releases once they have all started.
- **drain**: from the gate's release to the last waiter out. The ideal is
  N x hold (nothing between holders); **x ideal** is drain over that, and
  **x redis** drain over native async Redis's (the ``redis`` alias) in the
  same run. Errors (``LockTimeout``, ``LockNotOwned`` on leaving) are
  counted; a run not done within ``--deadline`` counts who was served.

With ``--views``: uvicorn serves an async view per backend, guarded by
``@lock_view(timeout=60)`` and holding the lock ``--hold`` seconds; N
requests are sent at once and their answers counted (200, 423, 5xx), with
the wall time from the first request sent to the last answer.

Timing is measured here, never asserted in tests (tests/test_async_starvation.py
checks the same scenarios for errors and order only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "testproject")]

from benchmarks.common import table  # noqa: E402
from tests.servers import (  # noqa: E402
    EtcdServer,
    RedisServer,
    free_port,
    port_open,
    start_cluster,
    wait_for,
)

BACKENDS = [
    "locmem", "db-sqlite", "db-postgresql", "db-mysql", "redis", "redis-fair",
    "redis-cluster", "redlock", "redis-django", "etcd",
]  # fmt: skip
TTL = 2.0
TIMEOUT = 60.0


async def waiters_on(alias: str, waiters: int, hold: float, deadline: float) -> dict[str, Any]:
    from django_dlock import lock

    served: list[int] = []
    errors: dict[str, int] = {}
    inside = [0, 0]

    async def waiter(index: int) -> None:
        try:
            async with lock("bench:one", backend=alias, ttl=TTL, timeout=TIMEOUT):
                inside[0] += 1
                inside[1] = max(inside)
                served.append(index)
                await asyncio.sleep(hold)
                inside[0] -= 1
        except Exception as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

    gate = await lock("bench:one", backend=alias, ttl=TTL).aacquire_handle()
    tasks = [asyncio.create_task(waiter(i)) for i in range(waiters)]
    await asyncio.sleep(0.5)  # every waiter has tried once and waits
    released = time.perf_counter()
    try:
        await gate.arelease()
    except Exception as e:  # its release queued behind the waiters until its lease ran out
        errors[f"gate {type(e).__name__}"] = 1
    _, pending = await asyncio.wait(tasks, timeout=deadline)
    drain = time.perf_counter() - released
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return {
        "alias": alias,
        "waiters": waiters,
        "served": len(served),
        "finished": not pending,
        "drain_s": drain,
        "errors": errors,
        "overlaps": inside[1] > 1,
    }


async def requests_to(port: int, alias: str, count: int) -> dict[str, Any]:
    """``count`` GETs at once to the view of ``alias``: how many of each status."""
    statuses: dict[str, int] = {}

    async def get() -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            request = (
                f"GET /hold/{alias}/ HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            )
            writer.write(request.encode())
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), TIMEOUT + 30)
            status = line.split()[1].decode() if line else "no answer"
            await reader.read()
            writer.close()
        except Exception as e:
            status = type(e).__name__
        statuses[status] = statuses.get(status, 0) + 1

    began = time.perf_counter()
    await asyncio.gather(*(get() for _ in range(count)))
    return {"alias": alias, "requests": count, "statuses": statuses,
            "wall_s": time.perf_counter() - began}  # fmt: skip


def start_servers() -> list[Any]:
    from django.conf import settings

    ports = settings.REDIS_PORTS
    servers: list[Any] = [RedisServer(ports["single"]).start()]
    servers += start_cluster(ports["cluster"])
    servers += [RedisServer(port).start() for port in ports["redlock"]]
    client, peer = settings.ETCD_PORTS["single"]
    servers.append(EtcdServer("single", client, peer, {"single": peer}).start())
    return servers


def serve_views(database_names: dict[str, str], hold: float) -> tuple[subprocess.Popen[Any], int]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{ROOT / 'testproject'}",
        "DJANGO_SETTINGS_MODULE": "benchmarks.async_views_settings",
        "DLOCK_BENCH_DATABASES": json.dumps(database_names),
        "DLOCK_BENCH_HOLD": str(hold),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "benchmarks.async_views_asgi:application",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
         "--no-access-log"],
        cwd=ROOT, env=env,
    )  # fmt: skip
    wait_for(lambda: port_open("127.0.0.1", port), 30, "uvicorn")
    return process, port


def drop_other_sessions() -> None:
    """End the PostgreSQL sessions the backends' threads keep, so the test database can go."""
    from django.db import connections

    for connection in connections.all():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            connection.close()


def ratio(value: float, base: float | None) -> str:
    return f"{value / base:.1f}" if base else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=100)
    parser.add_argument("--hold", type=float, default=0.01)
    parser.add_argument("--deadline", type=float, default=60.0,
                        help="seconds a backend's run may take before it is stopped")  # fmt: skip
    parser.add_argument("--only", action="append", choices=BACKENDS)
    parser.add_argument("--views", action="store_true", help="also through uvicorn")
    parser.add_argument("--views-only", action="store_true", help="only through uvicorn")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    import django

    django.setup()
    from django.conf import settings
    from django.test.utils import setup_databases, teardown_databases

    aliases = [
        a for a in args.only or BACKENDS
        if a in settings.DLOCK_BACKENDS and a not in settings.UNAVAILABLE_BACKENDS
    ]  # fmt: skip
    servers = start_servers()
    databases = setup_databases(verbosity=0, interactive=False, aliases=set(settings.DATABASES))
    from django.db import connections

    names = {alias: connections[alias].settings_dict["NAME"] for alias in settings.DATABASES}
    rows: list[dict[str, Any]] = []
    views: list[dict[str, Any]] = []
    try:
        for alias in [] if args.views_only else aliases:
            rows.append(asyncio.run(waiters_on(alias, args.waiters, args.hold, args.deadline)))
            print(f"{alias}: {rows[-1]}", file=sys.stderr, flush=True)
        if args.views or args.views_only:
            process, port = serve_views(names, args.hold)
            try:
                for alias in aliases:
                    views.append(asyncio.run(requests_to(port, alias, args.waiters)))
                    print(f"view {alias}: {views[-1]}", file=sys.stderr, flush=True)
            finally:
                process.terminate()
                process.wait(timeout=30)
    finally:
        try:
            connections.close_all()
            drop_other_sessions()
            teardown_databases(databases, verbosity=0)
        finally:
            for server in servers:
                server.cleanup()

    ideal = args.waiters * args.hold
    native = next((r["drain_s"] for r in rows if r["alias"] == "redis"), None)
    header = (
        f"{args.waiters} async waiters on one lock, {args.hold * 1000:g} ms hold each "
        f"(ideal {ideal:.2f} s), TTL {TTL:g} s, timeout {TIMEOUT:g} s; Python "
        f"{sys.version.split()[0]}; {os.cpu_count()} CPUs"
    )
    cells = [["backend", "served", "all", "errors", "drain s", "x ideal", "x redis"]]
    for r in rows:
        cells.append([
            r["alias"], f"{r['served']}/{r['waiters']}", "yes" if r["finished"] else "NO",
            ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "0",
            f"{r['drain_s']:.2f}", ratio(r["drain_s"], ideal), ratio(r["drain_s"], native),
        ])  # fmt: skip
    out = [header, "", table(cells)]
    if views:
        native_view = next((v["wall_s"] for v in views if v["alias"] == "redis"), None)
        cells = [["view backend", "200", "423", "5xx", "other", "wall s", "x ideal", "x redis"]]
        for v in views:
            s = v["statuses"]
            fives = sum(n for k, n in s.items() if k.startswith("5"))
            other = sum(
                n for k, n in s.items() if k not in ("200", "423") and not k.startswith("5")
            )
            cells.append([
                v["alias"], str(s.get("200", 0)), str(s.get("423", 0)), str(fives), str(other),
                f"{v['wall_s']:.2f}", ratio(v["wall_s"], ideal), ratio(v["wall_s"], native_view),
            ])  # fmt: skip
        out += ["", f"Through uvicorn: {args.waiters} concurrent requests to an async "
                "@lock_view(timeout=60) holding the lock each time", "", table(cells)]  # fmt: skip
    print("\n".join(out))
    if args.json:
        args.json.write_text(json.dumps({"header": header, "runs": rows, "views": views},
                                        indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
