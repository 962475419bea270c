"""What the benchmarks share: pool warm-up and the plain-text tables they print."""

from __future__ import annotations

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
