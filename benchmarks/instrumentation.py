"""What the signals and the contrib integrations cost per acquire/release cycle.

    .venv/bin/python benchmarks/instrumentation.py                 # about a minute
    DLOCK_BENCH_CODE=/tmp/before .venv/bin/python benchmarks/instrumentation.py --modes off

Uncontended acquire/release cycles in one thread, on the locmem backend (where
the lock's own Python code is most of a cycle, so an overhead shows most) and
on Redis (a redis-server this script starts), in interleaved rounds, for:

- off:        nothing connected to the signals (the default);
- prometheus: ``django_dlock.contrib.prometheus.install()`` on a registry of
              its own;
- otel:       ``django_dlock.contrib.opentelemetry.install()`` on an SDK
              tracer provider with no exporter (spans are made and ended).

Ratios are to "off" in the same run. ``DLOCK_BENCH_CODE`` naming a directory
that holds another ``django_dlock`` (``git archive REV django_dlock | tar -x
-C /tmp/before``) measures that code instead: its "off" is the code before a
change.
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
sys.path.insert(0, str(ROOT))
if os.environ.get("DLOCK_BENCH_CODE"):
    sys.path.insert(0, os.environ["DLOCK_BENCH_CODE"])

from benchmarks.common import table  # noqa: E402

MODES = ("off", "prometheus", "otel")


def install(mode: str) -> Any:
    if mode == "prometheus":
        from prometheus_client import CollectorRegistry

        from django_dlock.contrib import prometheus

        prometheus.install(registry=CollectorRegistry())
        return prometheus.uninstall
    if mode == "otel":
        from opentelemetry.sdk.trace import TracerProvider

        from django_dlock.contrib import opentelemetry

        opentelemetry.install(tracer_provider=TracerProvider())
        return opentelemetry.uninstall
    return lambda: None


def cycles_per_second(alias: str, cycles: int) -> float:
    from django_dlock import locks

    backend = locks[alias]
    started = time.perf_counter()
    for i in range(cycles):
        backend.acquire(f"bench:{i % 16}", ttl=30).release()
    return cycles / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    modes = args.modes.split(",")

    from tests.servers import RedisServer, free_port

    server = RedisServer(free_port()).start()
    os.environ["DLOCK_BENCH_REDIS_URL"] = f"redis://127.0.0.1:{server.port}/0"
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.instrumentation_settings"
    import django

    django.setup()
    import django_dlock

    cycles = {"locmem": 20000, "redis": 3000}
    results: dict[str, dict[str, list[float]]] = {a: {m: [] for m in modes} for a in cycles}
    try:
        for alias, n in cycles.items():
            cycles_per_second(alias, n // 10)  # warm up
            for _ in range(args.rounds):
                for mode in modes:
                    uninstall = install(mode)
                    try:
                        results[alias][mode].append(cycles_per_second(alias, n))
                    finally:
                        uninstall()
    finally:
        server.stop()
    print(f"code: {Path(django_dlock.__file__).parent}")
    print(f"median of {args.rounds} interleaved rounds; cycles: {cycles}")
    rows = [["backend", "mode", "cycles/s", "x off"]]
    summary: dict[str, dict[str, float]] = {}
    for alias, by_mode in results.items():
        off = statistics.median(by_mode[modes[0]])
        for mode, runs in by_mode.items():
            median = statistics.median(runs)
            summary.setdefault(alias, {})[mode] = median
            rows.append([alias, mode, f"{median:,.0f}", f"{median / off:.3f}"])
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
