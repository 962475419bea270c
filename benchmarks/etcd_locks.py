"""etcd locks compared in one run, on one etcd member that this script starts.

    .venv/bin/python benchmarks/etcd_locks.py            # about a minute
    .venv/bin/python benchmarks/etcd_locks.py --quick    # shorter, for a smoke test

Implementations, each with a 30 s lease; the floor on the backend's gRPC stubs
(django_dlock.backends.etcd.etcdrpc), etcd3-fc on its own (etcd3.etcdrpc):

- floor:    the raw two transactions: put the key if its create revision is 0
            (under a lease granted once and refreshed every 10 s), then delete
            it if its create revision is still ours; contended, it retries
            every 1 ms
- etcd3-fc: the client's built-in ``client.lock(name, ttl=30)``
            (a new lease per attempt, then it watches the key for a delete)
- ours:     ``django_dlock.lock(name, ttl=30)`` on ``EtcdBackend``: a queue key
            under the session lease, fencing token, holder metadata, and
            watchdog registration included

Uncontended: cycles/s of acquire + release by one process, the median of
interleaved rounds, and the median of the ratios to the floor of the same
round (etcd's fsync time drifts during a run, so rounds are paired).
etcd3-fc runs after ours, in its own rounds with the floor: its Lock leaves a
lease per acquisition that etcd revokes 30 s later, a raft write each, which
would slow whatever else ran then.

Hand-off: 4 processes take turns on one lock for a fixed window, holding it
1 ms. Hand-off latency is the time from one holder's release to the next
grant (both on the machine's monotonic clock, which the processes share).
Arrival order: pairs of acquisitions where the one that asked first (by more
than 2 ms, about a round trip, so that requests racing to the server do not
count) got the lock second. A strict FIFO queue has none.
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
RACE = 0.002  # requests closer together than this may reach etcd in either order


class Impl:
    """acquire(name) blocks until held and returns what release() needs."""

    def __init__(self, kind: str, endpoint: str) -> None:
        self.kind = kind
        if kind == "etcd3-fc":
            # The peer, and the only user of etcd3-fc (the bench group's): its
            # stubs and ours load side by side, each in its own descriptor pool.
            import etcd3

            host, port = endpoint.rsplit(":", 1)
            self.client = etcd3.client(host=host, port=int(port))
        elif kind == "floor":
            import grpc

            from django_dlock.backends.etcd import etcdrpc as rpc

            self.rpc = rpc
            self.channel = grpc.insecure_channel(endpoint)
            self.kv = rpc.KVStub(self.channel)
            self.leases = rpc.LeaseStub(self.channel)
            self.lease = self.leases.LeaseGrant(rpc.LeaseGrantRequest(TTL=TTL)).ID
            self.refreshed = time.monotonic()

    def acquire(self, name: str) -> Any:
        if self.kind == "floor":
            rpc = self.rpc
            if time.monotonic() - self.refreshed > TTL / 3:  # keep the lease, as ours does
                keepalive = iter([rpc.LeaseKeepAliveRequest(ID=self.lease)])
                list(self.leases.LeaseKeepAlive(keepalive))
                self.refreshed = time.monotonic()
            key = f"bench/{name}".encode()
            put = rpc.TxnRequest(
                compare=[rpc.Compare(key=key, target=rpc.Compare.CREATE, create_revision=0)],
                success=[
                    rpc.RequestOp(
                        request_put=rpc.PutRequest(key=key, value=b"x", lease=self.lease)
                    )
                ],
            )
            while True:
                reply = self.kv.Txn(put)
                if reply.succeeded:
                    return (key, reply.header.revision)
                time.sleep(0.001)
        if self.kind == "etcd3-fc":
            held = self.client.lock(name, ttl=TTL)
            held.acquire(timeout=None)
            return held
        from django_dlock import lock

        return lock(name, ttl=TTL).acquire()

    def release(self, name: str, held: Any) -> None:
        if self.kind == "floor":
            rpc = self.rpc
            key, revision = held
            self.kv.Txn(
                rpc.TxnRequest(
                    compare=[
                        rpc.Compare(key=key, target=rpc.Compare.CREATE, create_revision=revision)
                    ],
                    success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))],
                )
            )
        else:
            held.release()


def setup_django(endpoint: str) -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=["django_dlock"],
            DLOCK_BACKENDS={
                "default": {
                    "BACKEND": "django_dlock.backends.etcd.EtcdBackend",
                    "LOCATION": endpoint,
                }
            },
            USE_TZ=True,
        )
        django.setup()


def uncontended(endpoint: str, kinds: list[str], cycles: int, rounds: int) -> dict[str, Any]:
    """``kinds`` (the floor first) in interleaved rounds; rates and ratios to the floor."""
    impls = {kind: Impl(kind, endpoint) for kind in kinds}
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    for kind, impl in impls.items():  # warm up channels and sessions
        for _ in range(50):
            impl.release(f"warm:{kind}", impl.acquire(f"warm:{kind}"))
    for r in range(rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for kind in order:
            impl, name = impls[kind], f"un:{kind}"
            started = time.perf_counter()
            for _ in range(cycles):
                impl.release(name, impl.acquire(name))
            rates[kind].append(cycles / (time.perf_counter() - started))
    # etcd's fsync time drifts during a run: compare each round with the floor
    # of the same round, then take the median of those ratios.
    return {
        kind: {
            "cycles_per_s": statistics.median(values),
            "x_floor": statistics.median(
                v / f for v, f in zip(values, rates["floor"], strict=True)
            ),
        }
        for kind, values in rates.items()
    }


def _window(args: tuple[str, str, str, float, float]) -> list[tuple[float, float, float, int]]:
    """One process's part: (requested, granted, released, pid) per acquisition."""
    kind, endpoint, name, start_at, stop_at = args
    setup_django(endpoint)
    impl = Impl(kind, endpoint)
    impl.release(f"warm:{os.getpid()}", impl.acquire(f"warm:{os.getpid()}"))
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


def handoff(pool: Any, endpoint: str, kind: str, procs: int, window: float) -> dict[str, float]:
    name = f"co:{kind}:{uuid.uuid4().hex[:6]}"
    start_at = time.monotonic() + 1.5
    parts = pool.map(
        _window, [(kind, endpoint, name, start_at, start_at + window)] * procs, chunksize=1
    )
    return handoff_stats(parts, procs, window, RACE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows and few cycles")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    cycles, rounds, window = (200, 3, 1.0) if args.quick else (300, 15, 3.0)
    procs = 4

    from tests.servers import EtcdServer, etcdctl, free_port

    client, peer = free_port(), free_port()
    server = EtcdServer("bench", client, peer, {"bench": peer}).start()
    try:
        endpoint = server.endpoint
        setup_django(endpoint)
        version = etcdctl(endpoint, "version").stdout.split("\n")[0]
        print(f"{version} on {endpoint}; Python {sys.version.split()[0]}; {os.cpu_count()} cores")
        # etcd3-fc's Lock leaves a lease per acquisition, which etcd revokes
        # (a raft write each) 30 s later, slowing whatever runs then: so it is
        # measured in its own rounds against the floor, after ours.
        rates = uncontended(endpoint, ["floor", "ours"], cycles, rounds)
        rates["etcd3-fc"] = uncontended(endpoint, ["floor", "etcd3-fc"], cycles, 5)["etcd3-fc"]
        print(
            f"\nUncontended: one process, interleaved rounds of {cycles} cycles with the "
            f"floor ({rounds} for ours, then 5 for etcd3-fc); medians of the rate and of "
            "the ratio to the floor in the same round"
        )
        rows = [["implementation", "cycles/s", "x floor"]]
        rows += [
            [k, f"{rates[k]['cycles_per_s']:,.0f}", f"{rates[k]['x_floor']:.2f}"]
            for k in ("floor", "ours", "etcd3-fc")
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
            for kind in ("floor", "ours", "etcd3-fc"):  # etcd3-fc last, as above
                r = handoff(pool, endpoint, kind, procs, window)
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
        server.cleanup()


if __name__ == "__main__":
    main()
