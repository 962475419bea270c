"""Redis lock cycles on a thread per request: what a thread that comes and goes costs.

    .venv/bin/python benchmarks/redis_threads.py
    DLOCK_BENCH_CODE=/tmp/before .venv/bin/python benchmarks/redis_threads.py

Under ASGI each sync request runs on a thread of its own. Each "request"
here is a new thread that runs 20 uncontended acquire/release cycles and
ends; rounds of 90 such threads run one after the other (90: code that kept
a connection per thread for good ran out of its pool's 100 after that), on a
redis-server this script starts, with a new backend per round. It prints
requests a second per round and their median. ``DLOCK_BENCH_CODE`` naming a
directory that holds another ``django_dlock`` (``git archive REV
django_dlock | tar -x -C /tmp/before``) measures that code instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if os.environ.get("DLOCK_BENCH_CODE"):
    sys.path.insert(0, os.environ["DLOCK_BENCH_CODE"])

from tests.servers import RedisServer, free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=90)
    parser.add_argument("--cycles", type=int, default=20, help="per thread")
    args = parser.parse_args()
    server = RedisServer(free_port()).start()
    try:
        import django
        from django.conf import settings

        settings.configure(
            INSTALLED_APPS=["django_dlock"],
            DATABASES={},
            DLOCK_BACKENDS={
                "default": {
                    "BACKEND": "django_dlock.backends.redis.RedisBackend",
                    "LOCATION": server.url,
                }
            },
        )
        django.setup()
        import django_dlock
        from django_dlock import locks

        print("code:", Path(django_dlock.__file__).parent)

        def request(i: int) -> None:
            backend = locks["default"]
            for _ in range(args.cycles):
                backend.acquire(f"bench:{i % 16}", ttl=30).release()

        rates = []
        for _ in range(args.rounds):
            locks["default"].close()  # a new client and pool per round
            started = time.perf_counter()
            for i in range(args.threads):
                thread = threading.Thread(target=request, args=(i,))
                thread.start()
                thread.join()
            rates.append(args.threads / (time.perf_counter() - started))
        print(
            f"requests/s ({args.cycles} cycles each, a thread each), "
            f"{args.rounds} rounds of {args.threads}: {[round(r) for r in rates]}, "
            f"median {statistics.median(rates):,.0f}"
        )
    finally:
        server.cleanup()


if __name__ == "__main__":
    main()
