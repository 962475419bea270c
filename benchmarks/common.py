"""What the benchmarks share: pool warm-up and the plain-text tables they print."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any


def _pid(_: int) -> int:
    time.sleep(0.2)
    return os.getpid()


def warm_pool(pool: Any, size: int) -> None:
    """Wait until every pool process has started, so each window gets its own."""
    for _ in range(50):
        if len(set(pool.map(_pid, range(size), chunksize=1))) == size:
            return
    raise RuntimeError("the process pool did not start all its workers")


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def handoff_stats(
    parts: list[list[tuple[float, float, float, int]]], procs: int, window: float, race: float
) -> dict[str, float]:
    """What a window of processes taking turns on one lock measured.

    ``parts``: per process, (requested, granted, released, pid) per acquisition.
    Hand-off latency: from one holder's release to the next grant, where the
    next had asked before that release. Arrival-order inversions: pairs where
    the one that asked first, by more than ``race`` seconds, got the lock second.
    """
    if len({part[0][3] for part in parts if part}) < procs:
        raise RuntimeError("the pool did not give each window its own process")
    records = sorted((r for part in parts for r in part), key=lambda r: r[1])
    handoffs = sorted(
        (b[1] - a[2]) * 1000
        for a, b in itertools.pairwise(records)
        if b[3] != a[3] and b[0] < a[2]
    )
    inversions = sum(
        1
        for a, b in itertools.combinations(records, 2)  # a granted before b
        if b[0] < a[0] - race  # b asked clearly first, yet was granted second
    )
    n = len(records)
    return {
        "cycles_per_s": n / window,
        "acquisitions": n,
        "handoffs": len(handoffs),
        "handoff_p50_ms": handoffs[len(handoffs) // 2] if handoffs else float("nan"),
        "handoff_p99_ms": handoffs[min(len(handoffs) - 1, int(len(handoffs) * 0.99))]
        if handoffs
        else float("nan"),
        "arrival_order_inversions": inversions,
        "fewest_per_process": min(len(part) for part in parts),
        "fair_share": n / procs,
    }
