"""Redis locks compared in one run, on one redis-server that this script starts.

    .venv/bin/python benchmarks/redis_locks.py            # about three minutes
    .venv/bin/python benchmarks/redis_locks.py --quick    # shorter windows, for a smoke test

Implementations, each used the way its documentation shows, with a 30 s lease:

- floor:      SET NX PX, then EVALSHA compare-and-delete; contended, it retries every 1 ms
- redis-py:   ``Redis.lock(name, timeout=30)`` (polls every 0.1 s, its default)
- redis_lock: python-redis-lock ``Lock(conn, name, expire=30)`` (BLPOP on release)
- pottery:    ``Redlock(key=name, masters={conn}, auto_release_time=30)``, one master
- ours:       ``django_dlock.lock(name, ttl=30)``: fencing token, holder metadata, the
              listing index and watchdog registration included
- ours-fair:  the same with ``OPTIONS={"fair": True}`` (FIFO queue)

Uncontended: cycles/s of acquire + release by one process, the median of
interleaved rounds, and the ratio to the floor measured in the same rounds.
Contended: 4 and 16 processes for a fixed window at hold times of 0 and 1 ms;
cycles/s, wait (request to grant) mean/p50/p99/max, and owner changes per
1,000 acquisitions (1,000 would mean the lock changed hands every time), and
the fewest turns any one process got against an even share (starvation).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import table, warm_pool  # noqa: E402

TTL = 30
IMPLS = ["floor", "redis-py", "redis_lock", "pottery", "ours", "ours-fair"]

# KEYS[1] lock; ARGV[1] token. Deletes the key if it still holds the token.
CAD = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class Impl:
    """acquire(name) blocks until held and returns what release() needs."""

    def __init__(self, kind: str, url: str) -> None:
        import redis

        self.kind = kind
        self.conn = redis.Redis.from_url(url)
        if kind == "floor":
            self.cad = self.conn.register_script(CAD)

    def acquire(self, name: str) -> Any:
        kind = self.kind
        if kind == "floor":
            token = uuid.uuid4().hex
            while not self.conn.set(name, token, nx=True, px=TTL * 1000):
                time.sleep(0.001)
            return token
        if kind == "redis-py":
            held = self.conn.lock(name, timeout=TTL)
            held.acquire()
            return held
        if kind == "redis_lock":
            import redis_lock

            held = redis_lock.Lock(self.conn, name, expire=TTL)
            held.acquire()
            return held
        if kind == "pottery":
            from pottery import Redlock

            held = Redlock(key=name, masters={self.conn}, auto_release_time=TTL)
            held.acquire()
            return held
        from django_dlock import lock

        return lock(name, ttl=TTL, backend="fair" if kind == "ours-fair" else "default").acquire()

    def release(self, name: str, held: Any) -> None:
        if self.kind == "floor":
            self.cad(keys=[name], args=[held])
        else:
            held.release()


def setup_django(url: str) -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        backend = "django_dlock.backends.redis.RedisBackend"
        settings.configure(
            INSTALLED_APPS=["django_dlock"],
            DLOCK_BACKENDS={
                "default": {"BACKEND": backend, "LOCATION": url},
                "fair": {"BACKEND": backend, "LOCATION": url, "OPTIONS": {"fair": True}},
            },
            USE_TZ=True,
        )
        django.setup()


# --- uncontended ------------------------------------------------------------------------


def uncontended(url: str, cycles: int, rounds: int) -> dict[str, float]:
    impls = {kind: Impl(kind, url) for kind in IMPLS}
    rates: dict[str, list[float]] = {kind: [] for kind in IMPLS}
    for kind, impl in impls.items():  # warm up connections and script caches
        for _ in range(200):
            impl.release(f"bench:warm:{kind}", impl.acquire(f"bench:warm:{kind}"))
    for r in range(rounds):
        order = IMPLS[r % len(IMPLS) :] + IMPLS[: r % len(IMPLS)]
        for kind in order:
            impl, name = impls[kind], f"bench:un:{kind}"
            started = time.perf_counter()
            for _ in range(cycles):
                impl.release(name, impl.acquire(name))
            rates[kind].append(cycles / (time.perf_counter() - started))
    return {kind: statistics.median(values) for kind, values in rates.items()}


# --- contended --------------------------------------------------------------------------


def _worker_init(url: str) -> None:
    setup_django(url)


def _window(args: tuple[str, str, str, float, float, float]) -> list[tuple[float, float, int]]:
    """One process's part of a contended run: (requested, granted, pid) per acquisition."""
    kind, url, name, hold, start_at, stop_at = args
    impl = Impl(kind, url)
    records = []
    pid = os.getpid()
    time.sleep(max(0.0, start_at - time.monotonic()))
    while time.monotonic() < stop_at:
        requested = time.monotonic()
        held = impl.acquire(name)
        granted = time.monotonic()
        if hold:
            time.sleep(hold)
        impl.release(name, held)
        records.append((requested, granted, pid))
    return records


def contended(
    pool: Any, url: str, kind: str, procs: int, hold: float, window: float
) -> dict[str, float]:
    name = f"bench:co:{kind}:{procs}:{hold}:{uuid.uuid4().hex[:6]}"
    start_at = time.monotonic() + 0.5
    stop_at = start_at + window
    parts = pool.map(_window, [(kind, url, name, hold, start_at, stop_at)] * procs, chunksize=1)
    if len({part[0][2] for part in parts if part}) < procs:
        raise RuntimeError("the pool did not give each window its own process")
    records = sorted((r for part in parts for r in part), key=lambda r: r[1])
    waits = sorted((granted - requested) * 1000 for requested, granted, _ in records)
    changes = sum(1 for a, b in itertools.pairwise(records) if a[2] != b[2])
    n = len(records)
    elapsed = max(r[1] for r in records) - start_at if records else window
    return {
        "cycles_per_s": n / elapsed,
        "acquisitions": n,
        "wait_mean_ms": statistics.fmean(waits),
        "wait_p50_ms": waits[n // 2],
        "wait_p99_ms": waits[min(n - 1, int(n * 0.99))],
        "wait_max_ms": waits[-1],
        "owner_changes_per_1000": changes / n * 1000,
        "owner_changes_of_max": changes / (n - 1) if n > 1 else 0.0,
        # Starvation shows as one process getting far fewer turns than the rest.
        "fewest_per_process": min(len(part) for part in parts),
        "fair_share": n / procs,
    }


# --- report -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows and few cycles")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    cycles, rounds, window = (500, 3, 0.5) if args.quick else (3000, 5, 2.0)

    from tests.servers import RedisServer, free_port

    server = RedisServer(free_port()).start()
    try:
        url = server.url
        setup_django(url)
        import redis

        info = redis.Redis.from_url(url).info("server")
        print(
            f"redis-server {info['redis_version']} on {url}; Python {sys.version.split()[0]}; "
            f"{os.cpu_count()} cores"
        )
        rates = uncontended(url, cycles, rounds)
        floor = rates["floor"]
        print(f"\nUncontended: one process, median of {rounds} rounds of {cycles} cycles")
        rows = [["implementation", "cycles/s", "x floor"]]
        rows += [[k, f"{rates[k]:,.0f}", f"{rates[k] / floor:.2f}"] for k in IMPLS]
        print(table(rows))

        results: dict[str, Any] = {"uncontended": rates, "contended": []}
        context = multiprocessing.get_context("spawn")
        with context.Pool(16, initializer=_worker_init, initargs=(url,)) as pool:
            warm_pool(pool, 16)
            for procs in (4, 16):
                for hold in (0.0, 0.001):
                    print(
                        f"\nContended: {procs} processes, hold {hold * 1000:g} ms, "
                        f"{window:g} s window"
                    )
                    rows = [
                        [
                            "implementation", "cycles/s", "wait mean ms", "p50", "p99",
                            "max", "owner changes /1000", "fewest turns / fair share",
                        ]
                    ]  # fmt: skip
                    for kind in IMPLS:
                        r = contended(pool, url, kind, procs, hold, window)
                        results["contended"].append(
                            {"impl": kind, "procs": procs, "hold_ms": hold * 1000, **r}
                        )
                        rows.append(
                            [
                                kind,
                                f"{r['cycles_per_s']:,.0f}",
                                f"{r['wait_mean_ms']:.2f}",
                                f"{r['wait_p50_ms']:.2f}",
                                f"{r['wait_p99_ms']:.2f}",
                                f"{r['wait_max_ms']:.1f}",
                                f"{r['owner_changes_per_1000']:.0f}",
                                f"{r['fewest_per_process']} / {r['fair_share']:.0f}",
                            ]
                        )
                    print(table(rows))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        server.cleanup()


if __name__ == "__main__":
    main()
