"""10,000 asyncio waiters on one Redis lock in one process, with ``fair=True``.

    .venv/bin/python benchmarks/async_waiters.py                    # 10,000 waiters
    .venv/bin/python benchmarks/async_waiters.py --waiters 1000     # smaller

Starts its own redis-server (default settings: ``maxclients`` 10,000), then
runs each implementation in a fresh Python process (so that peak RSS and CPU
time are its own):

- asyncio.Lock: ``asyncio.Lock()`` in the process; no Redis. The floor.
- ours-fair:    ``async with lock("one", backend="fair")``, a backend with
                ``OPTIONS={"fair": True}`` (benchmarks/async_waiters_settings.py).
- ours-unfair:  the same on a backend without ``fair``.
- redis-py:     ``redis.asyncio.lock.Lock`` (SET NX, retried every 0.1 s), on a
                ``BlockingConnectionPool`` of 100 connections (its default pool
                fails the waiters beyond 100 with MaxConnectionsError).

Each run: one task takes the lock first (the gate) and starts N waiter
tasks, each entering the lock once; the gate waits until all N are waiting
(for ours: until the lock's queue, ``{dlock:0}:q:one``, holds N waiters),
then reads the **arrival order** (ours: the queue as Redis holds it, i.e. the
order in which Redis ran the enqueueing ACQUIRE scripts; asyncio.Lock: the
order the tasks called ``acquire()``; redis-py has none, its column is
against the order the tasks started) and releases. The **service order** is
the order the waiters enter the block. Checked: every waiter served exactly
once, never two inside at once, fencing tokens strictly increasing, and the
number of pairs served against arrival order (inversions; 0 is FIFO).

Reported per run: wall time to fill (all N waiting) and to drain (gate
release to the last waiter out), CPU time of the process (getrusage) and of
redis-server, peak RSS and its growth per waiter, Redis connections (peak
connected clients, sampled every 50 ms, and connections opened) and Redis
commands per waiter (INFO commandstats, before and after). Ratios are to
asyncio.Lock measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import table  # noqa: E402

SETTINGS = "benchmarks.async_waiters_settings"
IMPLEMENTATIONS = ["asyncio.Lock", "ours-fair", "ours-unfair", "redis-py"]
NAME = "one"
QUEUE_KEY = "{dlock:0}:q:one"


def inversions(order: list[int]) -> int:
    """Pairs (i < j) with order[i] > order[j]: 0 when served in arrival order."""
    size = max(order, default=0) + 2
    tree = [0] * size
    count = 0
    for seen, value in enumerate(order):
        i, below = value + 1, 0
        while i > 0:
            below += tree[i]
            i -= i & -i
        count += seen - below
        i = value + 1
        while i < size:
            tree[i] += 1
            i += i & -i
    return count


def rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Run:
    """What one child process observes."""

    def __init__(self, waiters: int) -> None:
        self.waiters = waiters
        self.started: list[int] = []  # waiter indexes, in the order they started waiting
        self.served: list[int] = []
        self.owners: dict[str, int] = {}
        self.tokens: list[int] = []
        self.inside = 0
        self.overlaps = 0
        self.errors: dict[str, int] = {}
        #: What a run stopped at its deadline still reports.
        self.notes: dict[str, Any] = {}

    def enter(self, index: int, owner: str | None = None, token: int | None = None) -> None:
        self.inside += 1
        if self.inside > 1:
            self.overlaps += 1
        self.served.append(index)
        if owner is not None:
            self.owners[owner] = index
        if token is not None:
            self.tokens.append(token)

    def leave(self) -> None:
        self.inside -= 1

    def failed(self, error: BaseException) -> None:
        kind = type(error).__name__
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def asyncio_lock(run: Run, fill_timeout: float) -> dict[str, Any]:
    mutex = asyncio.Lock()

    async def waiter(index: int) -> None:
        run.started.append(index)  # the order acquire() is called: asyncio.Lock's queue
        async with mutex:
            run.enter(index)
            await asyncio.sleep(0)
            run.leave()

    await mutex.acquire()
    tasks = [asyncio.create_task(waiter(i)) for i in range(run.waiters)]
    began = time.perf_counter()
    while len(run.started) < run.waiters:
        await asyncio.sleep(0.01)
    filled = time.perf_counter()
    mutex.release()
    await asyncio.gather(*tasks)
    return {"fill_s": filled - began, "drain_s": time.perf_counter() - filled,
            "arrival": list(run.started)}  # fmt: skip


async def ours(run: Run, alias: str, fill_timeout: float) -> dict[str, Any]:
    import redis.asyncio

    from django_dlock import lock

    url = os.environ["DLOCK_BENCH_REDIS_URL"]
    watcher = redis.asyncio.Redis.from_url(url)

    async def waiter(index: int) -> None:
        run.started.append(index)
        try:
            async with lock(NAME, backend=alias) as held:
                run.enter(index, held.owner, held.token)
                await asyncio.sleep(0)
                run.leave()
        except Exception as e:
            run.failed(e)

    async with lock(NAME, backend=alias) as gate:
        run.tokens.append(gate.token)
        tasks = [asyncio.create_task(waiter(i)) for i in range(run.waiters)]
        began = time.perf_counter()
        queued = 0
        while time.perf_counter() - began < fill_timeout:
            queued = await watcher.llen(QUEUE_KEY)
            run.notes["queued_at_release"] = queued
            if queued >= run.waiters:
                break
            await asyncio.sleep(0.05)
        filled = time.perf_counter()
        run.notes["fill_s"] = filled - began
        arrival_owners = [o.decode() for o in await watcher.lrange(QUEUE_KEY, 0, -1)]
        run.notes["arrival_owners"] = arrival_owners
    await asyncio.gather(*tasks)
    drained = time.perf_counter()
    await watcher.aclose()
    return {"fill_s": filled - began, "drain_s": drained - filled, "queued_at_release": queued,
            "arrival_owners": arrival_owners}  # fmt: skip


async def redis_py(run: Run, fill_timeout: float) -> dict[str, Any]:
    import redis.asyncio

    # A pool that waits for a free connection: with redis-py's default one,
    # waiters beyond its 100 connections fail with MaxConnectionsError.
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        os.environ["DLOCK_BENCH_REDIS_URL"], max_connections=100, timeout=None
    )
    client = redis.asyncio.Redis(connection_pool=pool)

    async def waiter(index: int) -> None:
        run.started.append(index)
        mutex = client.lock("redis-py:one", timeout=30, sleep=0.1)
        try:
            async with mutex:
                run.enter(index)
                await asyncio.sleep(0)
                run.leave()
        except Exception as e:
            run.failed(e)

    gate = client.lock("redis-py:one", timeout=30)
    await gate.acquire()
    tasks = [asyncio.create_task(waiter(i)) for i in range(run.waiters)]
    began = time.perf_counter()
    while len(run.started) < run.waiters and time.perf_counter() - began < fill_timeout:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # every waiter has tried once and sleeps
    filled = time.perf_counter()
    run.notes.update(fill_s=filled - began, arrival=run.started)
    await gate.release()
    await asyncio.gather(*tasks)
    drained = time.perf_counter()
    await client.aclose()
    return {"fill_s": filled - began, "drain_s": drained - filled, "arrival": list(run.started)}


def child(impl: str, waiters: int, fill_timeout: float, deadline: float) -> None:
    """Run one implementation in this process and print its figures as JSON."""
    if impl != "asyncio.Lock":
        os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
        import django

        django.setup()
        import redis.asyncio  # noqa: F401

        from django_dlock import lock  # noqa: F401
    run = Run(waiters)
    runner = {
        "asyncio.Lock": lambda: asyncio_lock(run, fill_timeout),
        "ours-fair": lambda: ours(run, "fair", fill_timeout),
        "ours-unfair": lambda: ours(run, "unfair", fill_timeout),
        "redis-py": lambda: redis_py(run, fill_timeout),
    }[impl]
    rss_before, cpu_before = rss_kib(), cpu_s()
    began = time.perf_counter()

    def emit(result: dict[str, Any], finished: bool) -> None:
        owners = result.pop("arrival_owners", None)
        arrival = result.pop("arrival", None)
        if arrival is None:
            arrival = [run.owners[o] for o in owners or () if o in run.owners]
        served = list(run.served)
        rank = {index: position for position, index in enumerate(arrival)}
        out = {
            "impl": impl,
            "waiters": waiters,
            "finished": finished,
            "wall_s": time.perf_counter() - began,
            "cpu_s": cpu_s() - cpu_before,
            "rss_before_kib": rss_before,
            "rss_peak_kib": rss_kib(),
            "served": len(served),
            "served_once": len(set(served)) == len(served),
            "overlaps": run.overlaps,
            "tokens_increasing": all(
                a < b for a, b in zip(run.tokens, run.tokens[1:], strict=False)
            ),
            "arrival_known": len(arrival),
            "inversions": inversions([rank[i] for i in served if i in rank]) if arrival else None,
            "in_arrival_order": len(arrival) == waiters and served == arrival,
            "errors": dict(run.errors),
            **result,
        }
        print(json.dumps(out), flush=True)
        os._exit(0)  # a run stopped at its deadline leaves tasks behind: do not wait for them

    # A run that is not done by its deadline reports what it saw so far, from
    # a thread: its event loop may be too busy to notice.
    late = {"error": f"not done within --deadline {deadline:g}s"}
    threading.Timer(deadline, lambda: emit({**run.notes, **late}, False)).start()
    try:
        result = asyncio.run(runner())
    except Exception as e:  # the run broke (the gate's own release failed, ...)
        result = {**run.notes, "error": f"{type(e).__name__}: {e}"[:300]}
    emit(result, len(run.served) == waiters)


class Sampler(threading.Thread):
    """Peak connected_clients of the server, sampled every 50 ms."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        import redis

        self.client = redis.Redis.from_url(url)
        self.peak = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            try:
                clients = self.client.info("clients")["connected_clients"] - 2
            except Exception:
                continue  # the server refuses clients beyond maxclients: so may it us
            self.peak = max(self.peak, clients)


def command_calls(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()}


def measure(impl: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    before = command_calls(client)
    stats_before = client.info("stats")["total_connections_received"]
    cpu_before = client.info("cpu")
    sampler = Sampler(url)
    sampler.start()
    env = {**os.environ, "DLOCK_BENCH_REDIS_URL": url, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", impl, "--waiters", str(args.waiters),
         "--fill-timeout", str(args.fill_timeout), "--deadline", str(args.deadline)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.deadline + 120,
    )  # fmt: skip
    sampler.stopping.set()
    sampler.join()
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"{impl} failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    after = command_calls(client)
    cpu_after = client.info("cpu")
    # The sampler's INFO, commandstats' own INFO and flushall are not the run's.
    ignored = {"info", "flushall"}
    calls = {
        name: count - before.get(name, 0)
        for name, count in after.items()
        if name not in ignored and count - before.get(name, 0) > 0
    }
    out["redis_commands"] = calls
    out["redis_commands_per_waiter"] = sum(calls.values()) / args.waiters
    out["redis_cpu_s"] = sum(
        cpu_after[k] - cpu_before[k] for k in ("used_cpu_user", "used_cpu_sys")
    )
    out["connections_opened"] = (
        client.info("stats")["total_connections_received"] - stats_before - 1
    )
    out["connections_peak"] = sampler.peak
    client.close()
    return out


def report(rows: list[dict[str, Any]], header: str) -> str:
    floor = next((r for r in rows if r["impl"] == "asyncio.Lock"), None)
    lines = [header, ""]
    cells = [["implementation", "all served", "served (once each)", "in order", "inversions",
              "overlaps", "fill s", "drain s", "wall s", "wall x floor", "CPU s", "CPU x floor",
              "redis CPU s", "peak RSS MiB", "KiB/waiter", "conns peak", "conns opened",
              "cmds/waiter"]]  # fmt: skip
    for r in rows:
        per_waiter = (r["rss_peak_kib"] - r["rss_before_kib"]) / r["waiters"]
        cells.append([
            r["impl"], "yes" if r["finished"] else "NO",
            f"{r['served']:,}" + ("" if r["served_once"] else " (some twice!)"),
            "yes" if r["in_arrival_order"] else "no",
            "-" if r["inversions"] is None else f"{r['inversions']:,}",
            str(r["overlaps"]),
            f"{r.get('fill_s', float('nan')):.2f}", f"{r.get('drain_s', float('nan')):.2f}",
            f"{r['wall_s']:.2f}",
            f"{r['wall_s'] / floor['wall_s']:.0f}" if floor else "-",
            f"{r['cpu_s']:.2f}",
            f"{r['cpu_s'] / floor['cpu_s']:.0f}" if floor and floor["cpu_s"] else "-",
            f"{r.get('redis_cpu_s', 0):.2f}",
            f"{r['rss_peak_kib'] / 1024:.0f}", f"{per_waiter:.1f}",
            f"{r.get('connections_peak', 0):,}", f"{r.get('connections_opened', 0):,}",
            f"{r.get('redis_commands_per_waiter', 0):.1f}",
        ])  # fmt: skip
    lines.append(table(cells))
    lines.append("")
    for r in rows:
        if r.get("redis_commands"):
            top = sorted(r["redis_commands"].items(), key=lambda kv: -kv[1])
            lines.append(f"{r['impl']} commands: " + ", ".join(f"{k} {v:,}" for k, v in top))
        if r["errors"]:
            lines.append(f"{r['impl']} errors of waiters: {r['errors']}")
        if r.get("error"):
            lines.append(f"{r['impl']} stopped: {r['error']}")
        if "queued_at_release" in r:
            lines.append(f"{r['impl']} waiters queued when the gate released: "
                         f"{r['queued_at_release']:,} of {r['waiters']:,}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=10_000)
    parser.add_argument("--only", action="append", choices=IMPLEMENTATIONS)
    parser.add_argument("--fill-timeout", type=float, default=60.0,
                        help="seconds the gate waits for all waiters to queue")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="seconds a run may take before it is stopped")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.waiters, args.fill_timeout, args.deadline)
        return

    from tests.servers import RedisServer, free_port

    server = RedisServer(free_port()).start()
    try:
        import redis

        info = redis.Redis.from_url(server.url).info("server")
        header = (
            f"{args.waiters:,} asyncio waiters on one lock, one process each run; "
            f"redis-server {info['redis_version']} (maxclients default); "
            f"Python {sys.version.split()[0]}; {os.cpu_count()} CPUs"
        )
        rows = []
        for impl in args.only or IMPLEMENTATIONS:
            rows.append(measure(impl, server.url, args))
            print(f"{impl}: done", file=sys.stderr, flush=True)
        print(report(rows, header))
        if args.json:
            args.json.write_text(json.dumps({"header": header, "runs": rows}, indent=2) + "\n")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
