"""Where a locked task's time goes: the lock's own steps, without the broker or a worker.

``celery_dedup.py`` measures whole round trips, in which the lock's part is a
few tenths of a millisecond; this times only what each library does per task,
in the process that does it, on the benchmark's own redis-server:

- run scope (worker): ``LockedTask``'s work around the body (key, acquire,
  release);
- queue scope: the caller's part of ``apply_async`` (key, acquire, detach)
  and the worker's (key, adopt, release);
- celery-singleton: its ``apply_async`` lock (key, SET NX) and its
  ``on_success`` unlock (key, DEL).

Rounds are interleaved; the fastest round of each is reported (the machine's
other load only adds). ``--profile run|queue-caller|queue-worker`` prints
cProfile's functions by their own time for that path.

Run: ``.venv/bin/python benchmarks/celery_paths.py [--profile PATH]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from tests.servers import RedisServer, free_port  # noqa: E402


class Request:
    """What ``LockedTask`` reads of a worker's request."""

    id = "6f1c1f8e-0000-4000-8000-000000000000"
    hostname = "celery@bench"
    called_directly = False
    headers: dict[str, Any] | None = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--profile", choices=["run", "queue-caller", "queue-worker"])
    args = parser.parse_args()

    redis = RedisServer(free_port()).start()
    os.environ["DLOCK_BENCH_REDIS"] = f"redis://127.0.0.1:{redis.port}"
    try:
        from benchmarks import celery_app  # configures Django too

        run_task = celery_app.ours_run._get_current_object()
        queue_task = celery_app.ours_queue._get_current_object()
        singleton = celery_app.singleton._get_current_object()
        tickets: dict[int, Any] = {}

        def run_scope(n: int) -> None:
            run_task._locked_call(Request, (n,), {}, lambda n: n)

        def queue_caller(n: int) -> None:
            key = queue_task.lock_key((n,), {})
            held = queue_task._acquire(key, 60.0, False, Request.id, None, (n,), {})
            tickets[n] = held.detach()

        def queue_worker(n: int) -> None:
            request = Request()
            request.django_dlock = tickets.pop(n)  # type: ignore[attr-defined]
            queue_task._locked_call(request, (n,), {}, lambda n: n)

        def singleton_caller(n: int) -> None:
            singleton.aquire_lock(singleton.generate_lock(singleton.name, (n,), {}), Request.id)

        def singleton_worker(n: int) -> None:
            singleton.release_lock((n,), {})

        # (label, the caller's step or None, the worker's step)
        paths: list[tuple[str, Callable[[int], None] | None, Callable[[int], None]]] = [
            ("ours (run scope)", None, run_scope),
            ("ours (queue scope)", queue_caller, queue_worker),
            ("celery-singleton", singleton_caller, singleton_worker),
        ]
        counter = iter(range(10**9))

        def timed(step: Callable[[int], None], numbers: list[int]) -> float:
            started = time.perf_counter()
            for n in numbers:
                step(n)
            return (time.perf_counter() - started) / len(numbers)

        times: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in paths}
        for round_ in range(args.rounds + 1):  # the first warms up
            for label, caller, worker in paths:
                numbers = [next(counter) for _ in range(args.calls)]
                spent = timed(caller, numbers) if caller else 0.0
                spent_worker = timed(worker, numbers)
                if round_:
                    times[label].append((spent, spent_worker))
        print(
            f"The lock's own steps per task, Redis on loopback; fastest of {args.rounds} "
            f"interleaved rounds of {args.calls} tasks; microseconds"
        )
        best = {label: min(rounds, key=sum) for label, rounds in times.items()}
        singleton_total = sum(best["celery-singleton"])
        print(f"{'':>20}  {'caller':>7}  {'worker':>7}  {'total':>7}  {'x singleton':>11}")
        for label, (caller_s, worker_s) in best.items():
            total = caller_s + worker_s
            print(
                f"{label:>20}  {caller_s * 1e6:7.1f}  {worker_s * 1e6:7.1f}  "
                f"{total * 1e6:7.1f}  {total / singleton_total:11.2f}"
            )
        if args.profile:
            numbers = [next(counter) for _ in range(args.calls)]
            if args.profile == "queue-worker":
                for n in numbers:
                    queue_caller(n)
            step = {"run": run_scope, "queue-caller": queue_caller, "queue-worker": queue_worker}
            profile = cProfile.Profile()
            profile.enable()
            for n in numbers:
                step[args.profile](n)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    finally:
        redis.cleanup()


if __name__ == "__main__":
    main()
