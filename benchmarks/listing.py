"""Listing held locks: ``manage.py locks --json`` with 100,000 and 1,000,000 leases on Redis.

    .venv/bin/python benchmarks/listing.py                            # about 3 minutes
    .venv/bin/python benchmarks/listing.py --locks 10000 --big 0      # smaller

Starts its own redis-server, takes N leases through the backend's own
ACQUIRE script (pipelined, with the arguments ``do_acquire`` sends; a 600 s
TTL, so none expires during the run; a third of them carry Celery task
metadata), then times, as the median of several runs:

- cli:       ``python -m django locks --json`` as a new process, Django's
             start-up included, output to a file (the target: under 2 s
             for 100,000), and its peak RSS;
- command:   ``call_command("locks", "--json")`` in this process;
- table:     ``call_command("locks")``, the aligned table, in this process;
- list():    ``locks["default"].list()`` alone (the LIST script and parsing;
             the target: under 1 s for 100,000);
- peer:      what a hand-written script does without an index: SCAN MATCH
             over the lock keys, GET and PTTL pipelined per batch, json.dumps
             of the same fields. Ratios are to this, measured in the same run.

Then it takes more leases, up to ``--big`` (1,000,000), and times the cli
again (median of up to 3 runs) with its peak RSS: the target is under 10 s
and under 1 GiB, which only a streamed output can meet.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import table  # noqa: E402

SETTINGS = "benchmarks.listing_settings"
TTL = 600


def setup_django(url: str) -> None:
    os.environ["DLOCK_BENCH_REDIS_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    import django

    django.setup()


def holders(count: int) -> Any:
    """The holder JSON of each lease: a third of them carry Celery task metadata."""
    from django_dlock._validation import holder_metadata

    plain = holder_metadata(TTL, None)[1]
    for i in range(count):
        if i % 3 == 0:
            extra = {"task_name": "billing.tasks.sync_account", "task_id": str(uuid.uuid4())}
            yield holder_metadata(TTL, extra)[1]
        else:
            yield plain


def lock_name(i: int) -> str:
    return f"account:{i:07d}:sync"


def fill(count: int, start: int = 0) -> None:
    """``count`` live leases, taken one call at a time by the backend's ``do_acquire``."""
    from django_dlock import locks
    from django_dlock._validation import new_owner

    backend = locks["default"]
    for i, holder in enumerate(holders(count), start):
        if backend.do_acquire(lock_name(i), new_owner(), TTL, holder) is None:
            raise RuntimeError("a lease in the benchmark's fill was refused")


def fast_fill(count: int, start: int = 0, batch: int = 5000) -> None:
    """``fill``, pipelined: the same ACQUIRE script with the arguments ``do_acquire`` sends.

    The keys and arguments come from the backend's own ``_acquire_args``
    for a fresh attempt, so the server runs exactly what ``do_acquire``
    makes it run, only ``batch`` calls per round trip. Every reply must be a
    new fencing token (a refusal is negative or a list).
    """
    from django_dlock import locks
    from django_dlock._validation import new_owner
    from django_dlock.backends.redis.scripts import ACQUIRE

    backend = locks["default"]
    client = backend.nodes[0].client
    client.script_load(ACQUIRE.text)
    pipe = client.pipeline(transaction=False)
    for i, holder in enumerate(holders(count), start):
        attempt = backend.attempt(lock_name(i), new_owner(), TTL, ({}, holder), True)
        keys, args = backend._acquire_args(attempt)
        pipe.evalsha(ACQUIRE.sha, len(keys), *keys, *args)
        if len(pipe) == batch or i == start + count - 1:
            replies = pipe.execute()
            if not all(isinstance(r, int) and r > 0 for r in replies):
                raise RuntimeError("a lease in the benchmark's fill was refused")


def median_of(runs: int, fn: Any) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cli_run(env: dict[str, str], out: Path, *, check_all: bool = True) -> tuple[float, int, int]:
    """One ``python -m django locks --json`` process writing to the file ``out``.

    Returns its seconds (start to exit), its peak RSS in KiB and the number
    of items in its output: parsed as JSON when ``check_all``, else counted
    by their ``"kind"`` key after checking the brackets (parsing 400 MB here
    would take several GiB in this process).

    The peak RSS is GNU time's ``%M``. The child's own ``ru_maxrss`` (from
    ``wait4``, or ``RUSAGE_CHILDREN``) counts the memory of the process it
    was forked from, before its ``exec``: this one, which grows with the
    fill; /usr/bin/time is a small process to be forked from.
    """
    rss_file = out.with_suffix(".rss")
    command = [sys.executable, "-m", "django", "locks", "--json"]
    with out.open("wb") as sink:
        started = time.perf_counter()
        subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *command],
            env=env,
            cwd=ROOT,
            stdout=sink,
            check=True,
        )
        elapsed = time.perf_counter() - started
    rss = int(rss_file.read_text().split()[-1])
    if check_all:
        with out.open("rb") as source:
            count = len(json.load(source))
    else:
        data = out.read_bytes()
        if not (data.startswith(b"[{") and data.endswith(b"}]\n")):
            raise RuntimeError("locks --json did not print one JSON array")
        count = data.count(b'"kind":"mutex"')
    return elapsed, rss, count


def peer(url: str) -> str:
    """SCAN + pipelined GET/PTTL + json.dumps: the script people write without an index."""
    import redis

    client = redis.Redis.from_url(url)
    items = []
    batch: list[bytes] = []

    def flush() -> None:
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.get(key)
            pipe.pttl(key)
        replies = pipe.execute()
        for key, value, pttl in zip(batch, replies[::2], replies[1::2], strict=True):
            if value is None or pttl < 0:
                continue
            _owner, token, acquired, holder = value.decode().split(":", 3)
            items.append(
                {
                    "name": key.decode().split(":lock:", 1)[1],
                    "token": int(token),
                    "holder": json.loads(holder),
                    "acquired_us": int(acquired),
                    "expires_in": pttl / 1000,
                }
            )
        batch.clear()

    for key in client.scan_iter(match="{dlock:0}:lock:*", count=1000):
        batch.append(key)
        if len(batch) == 1000:
            flush()
    if batch:
        flush()
    return json.dumps(items)


def cli_runs(
    env: dict[str, str], runs: int, count: int, out: Path
) -> tuple[float, tuple[float, float], float]:
    """``runs`` cli runs, each checked to list ``count`` items: median, range, peak RSS (MiB)."""
    cli = [cli_run(env, out, check_all=i == 0) for i in range(runs)]
    if any(n != count for _, _, n in cli):
        raise RuntimeError(f"locks --json listed {[n for _, _, n in cli]}, not {count}")
    seconds = [t for t, _, _ in cli]
    return (
        statistics.median(seconds),
        (min(seconds), max(seconds)),
        max(r for _, r, _ in cli) / 1024,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--locks", type=int, default=100_000, help="leases to list")
    parser.add_argument(
        "--big", type=int, default=1_000_000, help="then fill up to this many for the cli (0: no)"
    )
    parser.add_argument("--runs", type=int, default=5, help="runs per measurement (median)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from tests.servers import RedisServer, free_port

    server = RedisServer(free_port()).start()
    out = Path(server.dir) / "locks.json"
    big: dict[str, Any] = {}
    try:
        setup_django(server.url)
        from django.core.management import call_command

        from django_dlock import locks

        started = time.perf_counter()
        fast_fill(args.locks)
        fill_s = time.perf_counter() - started
        assert len(locks["default"].list()) == args.locks

        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DJANGO_SETTINGS_MODULE": SETTINGS,
            "DLOCK_BENCH_REDIS_URL": server.url,
        }
        cli_s, cli_range, cli_rss_mib = cli_runs(env, args.runs, args.locks, out)

        def command(*extra: str) -> None:
            call_command("locks", *extra, stdout=io.StringIO())

        results = {
            "cli": cli_s,
            "command": median_of(args.runs, lambda: command("--json")),
            "table": median_of(args.runs, lambda: command()),
            "list()": median_of(args.runs, lambda: locks["default"].list()),
            "peer": median_of(args.runs, lambda: peer(server.url)),
        }
        if args.big > args.locks:
            started = time.perf_counter()
            fast_fill(args.big - args.locks, start=args.locks)
            big["fill"] = time.perf_counter() - started
            big_s, big_range, big_rss = cli_runs(env, min(args.runs, 3), args.big, out)
            big.update(seconds=big_s, range=big_range, peak_rss_mib=big_rss)
    finally:
        out.unlink(missing_ok=True)
        server.cleanup()

    peer_s = results["peer"]
    rows = [["measurement", "seconds", "vs peer"]]
    for label, seconds in results.items():
        rows.append([label, f"{seconds:.3f}", f"{seconds / peer_s:.2f}x"])
    report = (
        f"{args.locks:,} leases on one redis-server, median of {args.runs} runs "
        f"(fill: {fill_s:.1f} s)\n\n{table(rows)}\n\n"
        f"cli: fastest {cli_range[0]:.3f} s, slowest {cli_range[1]:.3f} s, "
        f"peak RSS {cli_rss_mib:.0f} MiB; the target for cli is under 2 s, for list() under 1 s"
    )
    if big:
        report += (
            f"\n\n{args.big:,} leases (fill: {big['fill']:.1f} s), cli median of "
            f"{min(args.runs, 3)} runs: {big['seconds']:.3f} s (fastest {big['range'][0]:.3f} s, "
            f"slowest {big['range'][1]:.3f} s), peak RSS {big['peak_rss_mib']:.0f} MiB; "
            "the target is under 10 s and 1 GiB"
        )
    print(report)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "locks": args.locks,
                    "runs": args.runs,
                    "seconds": results,
                    "cli_range": cli_range,
                    "cli_peak_rss_mib": round(cli_rss_mib, 1),
                    "big": {
                        "locks": args.big,
                        "runs": min(args.runs, 3),
                        "fill_seconds": big["fill"],
                        "cli_seconds": big["seconds"],
                        "cli_range": big["range"],
                        "cli_peak_rss_mib": round(big["peak_rss_mib"], 1),
                    }
                    if big
                    else None,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
