"""ZooKeeper locks compared in one run, on a ZooKeeper server and an etcd member that
this script starts.

    .venv/bin/python benchmarks/zookeeper_locks.py            # about two minutes
    .venv/bin/python benchmarks/zookeeper_locks.py --quick    # shorter, for a smoke test

Implementations:

- floor:    raw kazoo, the two requests any lock on ZooKeeper needs: create an
            ephemeral sequential node, then delete it (no contention check)
- kazoo:    kazoo's own ``Lock(client, path)`` recipe (create, list the
            children, watch the one ahead; a new recipe object per acquisition)
- ours:     ``django_dlock.lock(name)`` on ``ZooKeeperBackend``: the same
            recipe, with a fencing token, holder metadata and watchdog
            registration included
- primitives: ours without the handle: the backend's ``do_acquire`` and
            ``do_release`` alone (no watchdog, signals or holder metadata)
- ours-etcd: ``django_dlock.lock(name)`` on ``EtcdBackend``, on the same machine

Uncontended: cycles/s of acquire + release by one process, the median of
interleaved rounds, and the median of the ratios to the floor of the same
round (both servers fsync, and their fsync time drifts during a run).

Hand-off: 16 processes take turns on one lock for a fixed window, holding it
1 ms. Hand-off latency is the time from one holder's release to the next
grant (the processes share the machine's monotonic clock). Arrival order:
pairs of acquisitions where the one that asked first (by more than 2 ms, a
round trip or so) got the lock second; a strict FIFO queue has none.
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

from benchmarks.common import handoff_stats, table, warm_pool  # noqa: E402

TTL = 30
HOLD = 0.001
RACE = 0.002  # requests closer together than this may reach the server in either order
SESSION = 10.0
PRIMITIVE_HOLDER = '{"host":"bench","pid":1,"thread":"MainThread","ttl":30.0}'


class Impl:
    """acquire(name) blocks until held and returns what release() needs."""

    def __init__(self, kind: str, hosts: str) -> None:
        self.kind = kind
        if kind in ("floor", "kazoo"):
            from kazoo.client import KazooClient

            self.client = KazooClient(hosts=hosts, timeout=SESSION)
            self.client.start(timeout=30)
            self.client.ensure_path("/bench")

    def acquire(self, name: str) -> Any:
        if self.kind == "primitives":
            from django_dlock import locks

            owner = uuid.uuid4().hex
            assert locks["default"].do_acquire(name, owner, TTL, PRIMITIVE_HOLDER, renew=False)
            return owner
        if self.kind == "floor":
            return self.client.create(f"/bench/{name}-", b"x", ephemeral=True, sequence=True)
        if self.kind == "kazoo":
            from kazoo.recipe.lock import Lock

            held = Lock(self.client, f"/kazoo/{name}", "bench")
            held.acquire()
            return held
        from django_dlock import lock

        alias = "etcd" if self.kind == "ours-etcd" else "default"
        return lock(name, backend=alias, ttl=TTL).acquire()

    def release(self, name: str, held: Any) -> None:
        if self.kind == "primitives":
            from django_dlock import locks

            assert locks["default"].do_release(name, held)
        elif self.kind == "floor":
            self.client.delete(held)
        else:
            held.release()


def setup_django(hosts: str, etcd: str) -> None:
    import logging

    import django

    # kazoo logs each lost connection; the pool's sessions lose theirs at the end.
    logging.getLogger("kazoo").setLevel(logging.CRITICAL)
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=["django_dlock"],
            DLOCK_BACKENDS={
                "default": {
                    "BACKEND": "django_dlock.backends.zookeeper.ZooKeeperBackend",
                    "LOCATION": hosts,
                    "OPTIONS": {"session_timeout": SESSION},
                },
                "etcd": {"BACKEND": "django_dlock.backends.etcd.EtcdBackend", "LOCATION": etcd},
            },
            USE_TZ=True,
        )
        django.setup()


def uncontended(hosts: str, kinds: list[str], cycles: int, rounds: int) -> dict[str, Any]:
    """``kinds`` (the floor first) in interleaved rounds; rates and ratios to the floor."""
    impls = {kind: Impl(kind, hosts) for kind in kinds}
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    for kind, impl in impls.items():  # warm up connections and sessions
        for _ in range(50):
            impl.release(f"warm-{kind}", impl.acquire(f"warm-{kind}"))
    for r in range(rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for kind in order:
            impl, name = impls[kind], f"un-{kind}"
            started = time.perf_counter()
            for _ in range(cycles):
                impl.release(name, impl.acquire(name))
            rates[kind].append(cycles / (time.perf_counter() - started))
    return {
        kind: {
            "cycles_per_s": statistics.median(values),
            "x_floor": statistics.median(
                v / f for v, f in zip(values, rates["floor"], strict=True)
            ),
        }
        for kind, values in rates.items()
    }


def _window(
    args: tuple[str, str, str, str, float, float],
) -> list[tuple[float, float, float, int]]:
    """One process's part: (requested, granted, released, pid) per acquisition."""
    kind, hosts, etcd, name, start_at, stop_at = args
    setup_django(hosts, etcd)
    impl = Impl(kind, hosts)
    impl.release(f"warm-{os.getpid()}", impl.acquire(f"warm-{os.getpid()}"))
    records = []
    pid = os.getpid()
    time.sleep(max(0.0, start_at - time.monotonic()))
    while time.monotonic() < stop_at:
        requested = time.monotonic()
        held = impl.acquire(name)
        granted = time.monotonic()
        time.sleep(HOLD)
        released = time.monotonic()
        impl.release(name, held)
        records.append((requested, granted, released, pid))
    return records


def handoff(
    pool: Any, hosts: str, etcd: str, kind: str, procs: int, window: float
) -> dict[str, float]:
    name = f"co-{kind}-{uuid.uuid4().hex[:6]}"
    start_at = time.monotonic() + 3.0
    parts = pool.map(
        _window, [(kind, hosts, etcd, name, start_at, start_at + window)] * procs, chunksize=1
    )
    return handoff_stats(parts, procs, window, RACE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows and few cycles")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    cycles, rounds, window = (200, 3, 2.0) if args.quick else (300, 11, 5.0)
    procs = 16

    from tests.servers import EtcdServer, free_port, start_zookeeper, zk_command

    [zk] = start_zookeeper([(free_port(), free_port(), free_port())])
    client, peer = free_port(), free_port()
    etcd = EtcdServer("bench", client, peer, {"bench": peer}).start()
    try:
        hosts = zk.endpoint
        setup_django(hosts, etcd.endpoint)
        version = zk_command(zk.client_port, "srvr").splitlines()[0]
        print(f"{version}; etcd on {etcd.endpoint}; Python {sys.version.split()[0]}; "
              f"{os.cpu_count()} cores")  # fmt: skip
        rates = uncontended(hosts, ["floor", "ours", "primitives", "kazoo"], cycles, rounds)
        rates["ours-etcd"] = uncontended(hosts, ["floor", "ours-etcd"], cycles, rounds)[
            "ours-etcd"
        ]
        print(
            f"\nUncontended: one process, interleaved rounds of {cycles} cycles with the "
            f"floor ({rounds} rounds); medians of the rate and of the ratio to the floor "
            "in the same round"
        )
        rows = [["implementation", "cycles/s", "x floor"]]
        rows += [
            [k, f"{rates[k]['cycles_per_s']:,.0f}", f"{rates[k]['x_floor']:.2f}"]
            for k in ("floor", "ours", "primitives", "kazoo", "ours-etcd")
        ]
        print(table(rows))

        results: dict[str, Any] = {"uncontended": rates, "handoff": []}
        context = multiprocessing.get_context("spawn")
        with context.Pool(procs) as pool:
            warm_pool(pool, procs)
            print(
                f"\nHand-off: {procs} processes on one lock, hold {HOLD * 1000:g} ms, {window:g} s"
            )
            rows = [
                [
                    "implementation", "cycles/s", "hand-offs", "hand-off p50 ms", "p99 ms",
                    "arrival-order inversions", "fewest turns / fair share",
                ]
            ]  # fmt: skip
            for kind in ("ours", "kazoo", "ours-etcd"):
                r = handoff(pool, hosts, etcd.endpoint, kind, procs, window)
                results["handoff"].append({"impl": kind, "procs": procs, **r})
                rows.append(
                    [
                        kind,
                        f"{r['cycles_per_s']:,.0f}",
                        f"{r['handoffs']}",
                        f"{r['handoff_p50_ms']:.2f}",
                        f"{r['handoff_p99_ms']:.2f}",
                        f"{r['arrival_order_inversions']}",
                        f"{r['fewest_per_process']} / {r['fair_share']:.0f}",
                    ]
                )
            print(table(rows))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        zk.cleanup()
        etcd.cleanup()


if __name__ == "__main__":
    main()
