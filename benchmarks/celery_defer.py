"""``limit=2`` on a real worker: parked calls (``on_locked="defer"``) against retrying ones.

One run, one broker (the benchmark's own redis-server), one real prefork
worker with 4 processes. 200 calls over one key are sent at once to a task
with ``limit=2``:

- defer: ``on_locked="defer"``: a call with no free slot is parked in the
  lock service and sent again when a run of the key ends;
- retry: ``on_locked="retry", countdown=0.05``: the way a limit is glued on
  without parking, retrying every 50 ms until a slot is free (celery-once and
  hand-written ``self.retry()`` loops work like this).

Reported per variant: the time until all 200 results are back, the most
bodies inside at once (counted by the bodies themselves), and the broker
messages the worker took for the task (``inspect().stats()``'s ``total``):
200 are the calls themselves, the rest are what the limit cost.

Run: ``.venv/bin/python benchmarks/celery_defer.py [--calls 200] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from benchmarks.common import table  # noqa: E402
from tests.servers import CeleryWorker, RedisServer, free_port  # noqa: E402

VARIANTS = {"defer": "limited_defer", "retry": "limited_retry"}


def taken(app: Any, task: str) -> int:
    """Messages of ``task`` the worker has taken so far."""
    stats = app.control.inspect(timeout=5).stats() or {}
    return sum(int((s.get("total") or {}).get(task, 0)) for s in stats.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--hold", type=float, default=0.02, help="seconds each body runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    redis_server = RedisServer(free_port()).start()
    url = f"redis://127.0.0.1:{redis_server.port}"
    os.environ["DLOCK_BENCH_REDIS"] = url
    worker = CeleryWorker(
        "bench-defer", f"{url}/1", f"{url}/2", queue="celery", concurrency=4,
        app="benchmarks.celery_app", loglevel="WARNING",
    )  # fmt: skip
    worker.env["PYTHONPATH"] = str(ROOT)
    results: dict[str, Any] = {"calls": args.calls, "hold": args.hold, "variants": {}}
    try:
        import redis

        from benchmarks import celery_app

        worker.start(ready=lambda: bool(celery_app.app.control.ping(timeout=0.5)))
        counts = redis.Redis.from_url(f"{url}/5")
        for variant, name in VARIANTS.items():
            task = getattr(celery_app, name)
            full = task.name
            task.delay("warm", 0, 0).get(timeout=30)
            before = taken(celery_app.app, full)
            key = f"{variant}-{uuid.uuid4().hex[:6]}"
            started = time.perf_counter()
            sent = [task.delay(key, n, args.hold) for n in range(args.calls)]
            inside = [r.get(timeout=600) for r in sent]
            elapsed = time.perf_counter() - started
            time.sleep(1.0)  # stats are counted as messages are taken
            messages = taken(celery_app.app, full) - before
            most = int(counts.get(f"most:{key}") or 0)
            results["variants"][variant] = {
                "seconds": elapsed, "most_inside": most, "max_returned": max(inside),
                "messages": messages, "extra_messages": messages - args.calls,
            }  # fmt: skip
        rows = [["variant", "seconds", "most inside at once", "messages taken",
                 "extra per call"]]  # fmt: skip
        for variant, r in results["variants"].items():
            extra = f"{r['extra_messages'] / args.calls:.2f}"
            rows.append([variant, f"{r['seconds']:.2f}", str(r["most_inside"]),
                         str(r["messages"]), extra])  # fmt: skip
        print(f"{args.calls} calls over one key, limit=2, bodies of {args.hold * 1000:g} ms, "
              "4 prefork processes\n")  # fmt: skip
        print(table(rows))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        worker.cleanup()
        redis_server.cleanup()


if __name__ == "__main__":
    main()
