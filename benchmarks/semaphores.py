"""Semaphores compared in one run, on one redis-server (and etcd) that this script starts.

    .venv/bin/python benchmarks/semaphores.py            # about two minutes
    .venv/bin/python benchmarks/semaphores.py --quick    # shorter windows, for a smoke test

Implementations, each with a limit of 4 and a 30 s lease:

- floor:           a raw Lua counting semaphore: one script drops expired members of a
                   sorted set (by Redis's TIME), grants if fewer than the limit remain;
                   release is ZREM. Contended, it retries every 1 ms. No token, no metadata.
- redis-semaphore: the ``redis-semaphore`` package's ``Semaphore(conn, count=4)``
                   (BLPOP on a list of free slots; no lease: a dead holder's slot is only
                   recovered by ``release_stale_locks``)
- ours:            ``django_dlock.semaphore(name, limit=4, ttl=30)`` on Redis: fencing
                   token, holder metadata, the listing index, the watchdog and wake-ups
- ours-etcd:       the same on etcd (contended runs only: FIFO by create revision)

Uncontended: cycles/s of acquire + release by one process, the median of interleaved
rounds, and the ratio to the floor measured in the same rounds.

Fairness: 16 processes at limit 4 for a fixed window, holding 1 ms; cycles/s, wait
(request to grant) p50/p99/max, and the fewest and most turns any process got against
an even share.
"""

from __future__ import annotations

import argparse
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
LIMIT = 4
UNCONTENDED = ["floor", "redis-semaphore", "ours"]
CONTENDED = ["floor", "redis-semaphore", "ours", "ours-etcd"]

# KEYS[1] the semaphore's sorted set; ARGV[1] member, ARGV[2] limit, ARGV[3] ttl ms.
ACQUIRE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  return 1
end
return 0
"""


class Impl:
    """acquire(name) blocks until a slot is held and returns what release() needs."""

    def __init__(self, kind: str, url: str) -> None:
        import redis

        self.kind = kind
        self.conn = redis.Redis.from_url(url)
        if kind == "floor":
            self.script = self.conn.register_script(ACQUIRE)
        self.peers: dict[str, Any] = {}

    def acquire(self, name: str) -> Any:
        kind = self.kind
        if kind == "floor":
            member = uuid.uuid4().hex
            while not self.script(keys=[name], args=[member, LIMIT, TTL * 1000]):
                time.sleep(0.001)
            return member
        if kind == "redis-semaphore":
            from redis_semaphore import Semaphore

            sem = self.peers.get(name)
            if sem is None:
                sem = self.peers[name] = Semaphore(self.conn, count=LIMIT, namespace=name)
            sem.acquire(timeout=0)  # BLPOP with no timeout: wait for a free slot
            return sem
        from django_dlock import semaphore

        alias = "etcd" if kind == "ours-etcd" else "default"
        return semaphore(name, limit=LIMIT, ttl=TTL, backend=alias).acquire_handle()

    def release(self, name: str, held: Any) -> None:
        if self.kind == "floor":
            self.conn.zrem(name, held)
        else:
            held.release()


def setup_django(url: str, etcd: str | None) -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        backends: dict[str, Any] = {
            "default": {"BACKEND": "django_dlock.backends.redis.RedisBackend", "LOCATION": url}
        }
        if etcd:
            backends["etcd"] = {"BACKEND": "django_dlock.backends.etcd.EtcdBackend",
                                "LOCATION": etcd}  # fmt: skip
        settings.configure(INSTALLED_APPS=["django_dlock"], DLOCK_BACKENDS=backends, USE_TZ=True)
        django.setup()


def uncontended(url: str, cycles: int, rounds: int) -> dict[str, float]:
    impls = {kind: Impl(kind, url) for kind in UNCONTENDED}
    rates: dict[str, list[float]] = {kind: [] for kind in UNCONTENDED}
    for kind, impl in impls.items():  # warm up connections and script caches
        for _ in range(200):
            impl.release(f"bench:warm:{kind}", impl.acquire(f"bench:warm:{kind}"))
    for r in range(rounds):
        order = UNCONTENDED[r % len(UNCONTENDED) :] + UNCONTENDED[: r % len(UNCONTENDED)]
        for kind in order:
            impl, name = impls[kind], f"bench:un:{kind}"
            started = time.perf_counter()
            for _ in range(cycles):
                impl.release(name, impl.acquire(name))
            rates[kind].append(cycles / (time.perf_counter() - started))
    return {kind: statistics.median(values) for kind, values in rates.items()}


_urls: dict[str, Any] = {}


def _worker_init(url: str, etcd: str | None) -> None:
    _urls["redis"] = url
    setup_django(url, etcd)


def _contend(args: tuple[str, str, float, float, float]) -> dict[str, Any]:
    kind, name, start_at, stop_at, hold = args
    impl = Impl(kind, _urls["redis"])
    impl.release(name + ":warm", impl.acquire(name + ":warm"))
    while time.time() < start_at:
        time.sleep(0.001)
    waits = []
    while time.time() < stop_at:
        asked = time.perf_counter()
        held = impl.acquire(name)
        waits.append(time.perf_counter() - asked)
        time.sleep(hold)
        impl.release(name, held)
    return {"turns": len(waits), "waits": waits}


def contended(pool: Any, kind: str, procs: int, hold: float, window: float) -> dict[str, Any]:
    name = f"bench:c:{kind}:{uuid.uuid4().hex[:6]}"
    start_at = time.time() + 1.0
    jobs = [(kind, name, start_at, start_at + window, hold)] * procs
    results = pool.map(_contend, jobs, chunksize=1)
    turns = [r["turns"] for r in results]
    waits = sorted(w * 1000 for r in results for w in r["waits"])
    total = sum(turns)
    return {
        "cycles_per_s": total / window,
        "wait_p50_ms": waits[len(waits) // 2],
        "wait_p99_ms": waits[min(len(waits) - 1, int(len(waits) * 0.99))],
        "wait_max_ms": waits[-1],
        "fewest": min(turns),
        "most": max(turns),
        "fair_share": total / procs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows and few cycles")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    cycles, rounds, window = (300, 3, 1.0) if args.quick else (2000, 5, 3.0)

    from tests.servers import EtcdServer, RedisServer, free_port

    server = RedisServer(free_port()).start()
    client, peer = free_port(), free_port()
    etcd = EtcdServer("bench", client, peer, {"bench": peer}).start()
    try:
        url, etcd_url = server.url, etcd.endpoint
        setup_django(url, etcd_url)
        import redis

        info = redis.Redis.from_url(url).info("server")
        print(
            f"redis-server {info['redis_version']} on {url}; etcd on {etcd_url}; "
            f"Python {sys.version.split()[0]}; {os.cpu_count()} cores; limit {LIMIT}"
        )
        rates = uncontended(url, cycles, rounds)
        floor = rates["floor"]
        print(f"\nUncontended: one process, median of {rounds} rounds of {cycles} cycles")
        rows = [["implementation", "cycles/s", "x floor"]]
        rows += [[k, f"{rates[k]:,.0f}", f"{rates[k] / floor:.2f}"] for k in UNCONTENDED]
        print(table(rows))
        results: dict[str, Any] = {"uncontended": rates, "fairness": []}
        procs, hold = 16, 0.001
        context = multiprocessing.get_context("spawn")
        with context.Pool(procs, initializer=_worker_init, initargs=(url, etcd_url)) as pool:
            warm_pool(pool, procs)
            print(f"\nFairness: {procs} processes, limit {LIMIT}, hold 1 ms, {window:g} s window")
            rows = [["implementation", "cycles/s", "wait p50 ms", "p99", "max",
                     "fewest / most turns", "fair share"]]  # fmt: skip
            for kind in CONTENDED:
                r = contended(pool, kind, procs, hold, window)
                results["fairness"].append({"impl": kind, "procs": procs, **r})
                turns = f"{r['fewest']} / {r['most']}"
                rows.append([kind, f"{r['cycles_per_s']:,.0f}", f"{r['wait_p50_ms']:.2f}",
                             f"{r['wait_p99_ms']:.2f}", f"{r['wait_max_ms']:.1f}",
                             turns, f"{r['fair_share']:.0f}"])  # fmt: skip
            print(table(rows))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        server.stop()
        etcd.cleanup()


if __name__ == "__main__":
    main()
