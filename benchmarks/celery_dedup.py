"""Per-task overhead of @locked_task against celery-singleton, celery-once and no lock.

One run, one broker (the benchmark's own redis-server), one real prefork
worker (2 processes) that has every task registered; the lock state of all
three libraries lives on the same server. Every call has distinct arguments,
so nothing is deduplicated: what is measured is what the lock costs a task
that runs. Variants are interleaved round by round and medians are reported.

- latency: one call at a time, from ``delay()`` until its result is back,
  the variants taking turns call by call;
- throughput: a batch of calls sent at once, until all results are back;
- overhead: the variant's time per task minus the undecorated task's, in the
  same round; ``x singleton`` is that overhead over celery-singleton's.

Run: ``.venv/bin/python benchmarks/celery_dedup.py [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from benchmarks.common import table  # noqa: E402
from tests.servers import CeleryWorker, RedisServer, free_port  # noqa: E402

VARIANTS = ["plain", "ours_run", "ours_queue", "singleton", "once"]
LABELS = {
    "plain": "no lock",
    "ours_run": "ours (run scope)",
    "ours_queue": "ours (queue scope)",
    "singleton": "celery-singleton",
    "once": "celery-once",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency-calls", type=int, default=100)
    parser.add_argument("--batch", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    redis = RedisServer(free_port()).start()
    url = f"redis://127.0.0.1:{redis.port}"
    os.environ["DLOCK_BENCH_REDIS"] = url
    worker = CeleryWorker(
        "bench",
        f"{url}/1",
        f"{url}/2",
        queue="celery",
        concurrency=2,
        app="benchmarks.celery_app",  # not the test project's
        loglevel="WARNING",
    )
    worker.env["PYTHONPATH"] = str(ROOT)
    try:
        from benchmarks import celery_app  # configures Django in this process too

        worker.start(ready=lambda: bool(celery_app.app.control.ping(timeout=0.5)))
        tasks = {name: getattr(celery_app, name) for name in VARIANTS}
        counter = iter(range(10**9))
        # Warm up: connections, the result consumer, every task in the worker.
        for task in tasks.values():
            for _ in range(20):
                task.delay(next(counter)).get(timeout=30)
        latency: dict[str, list[float]] = {v: [] for v in VARIANTS}
        batch: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            # Call by call in turn, so that a change in the machine's other
            # load falls on every variant alike.
            samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(args.latency_calls):
                for name, task in tasks.items():
                    started = time.perf_counter()
                    task.delay(next(counter)).get(timeout=30)
                    samples[name].append(time.perf_counter() - started)
            for name in VARIANTS:
                latency[name].append(statistics.median(samples[name]))
            for name, task in tasks.items():
                started = time.perf_counter()
                results = [task.delay(next(counter)) for _ in range(args.batch)]
                for result in results:
                    result.get(timeout=120)
                batch[name].append((time.perf_counter() - started) / args.batch)
        report(latency, batch, args)
    finally:
        worker.cleanup()
        redis.cleanup()


def report(latency: dict[str, list[float]], batch: dict[str, list[float]], args: Any) -> None:
    rounds = len(latency["plain"])

    def overhead(samples: dict[str, list[float]], name: str) -> float:
        return statistics.median(samples[name][i] - samples["plain"][i] for i in range(rounds))

    rows = [
        [
            "implementation",
            "latency p50 ms",
            "overhead ms",
            "x singleton",
            "throughput tasks/s",
            "overhead ms/task",
            "x singleton",
        ]
    ]
    data = {}
    for name in VARIANTS:
        lat = statistics.median(latency[name])
        per_task = statistics.median(batch[name])
        lat_over, batch_over = overhead(latency, name), overhead(batch, name)
        lat_ratio = lat_over / overhead(latency, "singleton")
        batch_ratio = batch_over / overhead(batch, "singleton")
        data[name] = {
            "latency_ms": lat * 1000,
            "latency_overhead_ms": lat_over * 1000,
            "latency_overhead_x_singleton": lat_ratio,
            "throughput": 1 / per_task,
            "batch_overhead_ms": batch_over * 1000,
            "batch_overhead_x_singleton": batch_ratio,
        }
        plain = name == "plain"
        rows.append(
            [
                LABELS[name],
                f"{lat * 1000:.2f}",
                "-" if plain else f"{lat_over * 1000:.2f}",
                "-" if plain else f"{lat_ratio:.2f}",
                f"{1 / per_task:.0f}",
                "-" if plain else f"{batch_over * 1000:.2f}",
                "-" if plain else f"{batch_ratio:.2f}",
            ]
        )
    print(
        f"Celery, Redis broker and result backend, prefork worker with 2 processes; {rounds} "
        f"rounds of {args.latency_calls} one-at-a-time calls (variants in turn) and of a "
        f"batch of {args.batch} per variant; medians"
    )
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "variants": data}, indent=2) + "\n")


if __name__ == "__main__":
    main()
