"""Draw the benchmark plots in docs/img/ from the committed results.

    .venv/bin/python benchmarks/plots.py

Reads benchmarks/results/redis_locks.json and etcd_locks.json (written by
redis_locks.py and etcd_locks.py with --json) and writes:

- bench-uncontended.png: acquire + release cycles/s of each implementation,
  as a ratio to the floor measured in the same run (Redis and etcd);
- bench-wait.png: wait from asking to being granted under contention
  (p50, mean, p99, max) for 16 Redis processes at each hold time;
- bench-owner-changes.png: owner changes per 1,000 acquisitions under
  contention, which show how often the lock changed hands (fairness);
- bench-watchdog.png: from watchdog.json and watchdog_before.json (written by
  watchdog.py with --json, after and before batched renewals), the leases one
  process kept and the CPU it used.
- bench-async-waiters.png: 10,000 asyncio waiters on one lock in one
  process (benchmarks/results/async_waiters.json, from async_waiters.py):
  wall and CPU time, memory and Redis commands per waiter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img"


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / name).read_text())
    return data


def uncontended(redis: dict[str, Any], etcd: dict[str, Any]) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), width_ratios=[6, 3])
    floor = redis["uncontended"]["floor"]
    names = list(redis["uncontended"])
    ratios = [redis["uncontended"][n] / floor for n in names]
    left.barh(names, ratios, color=["#888" if n == "floor" else "#3b6ea5" for n in names])
    left.set_title("Redis: cycles/s as a ratio to the floor")
    etcd_names = list(etcd["uncontended"])
    etcd_ratios = [etcd["uncontended"][n]["x_floor"] for n in etcd_names]
    right.barh(
        etcd_names, etcd_ratios, color=["#888" if n == "floor" else "#3b6ea5" for n in etcd_names]
    )
    right.set_title("etcd: cycles/s as a ratio to the floor")
    for axis, values in ((left, ratios), (right, etcd_ratios)):
        axis.invert_yaxis()
        axis.axvline(1.0, color="#555", linewidth=0.8, linestyle="--")
        axis.set_xlim(0, max(values) * 1.2)
        for y, value in enumerate(values):
            axis.text(value, y, f" {value:.2f}x", va="center", fontsize=9)
    fig.suptitle("Uncontended acquire + release, one process (higher is better)")
    fig.tight_layout()
    return _save(fig, "bench-uncontended.png")


def waits(redis: dict[str, Any], procs: int = 16) -> Path:
    rows = [r for r in redis["contended"] if r["procs"] == procs]
    holds = sorted({r["hold_ms"] for r in rows})
    fig, axes = plt.subplots(1, len(holds), figsize=(11, 3.8), sharey=True)
    for axis, hold in zip(axes, holds, strict=True):
        these = [r for r in rows if r["hold_ms"] == hold]
        names = [r["impl"] for r in these]
        for stat, marker in (("p50", "o"), ("mean", "s"), ("p99", "^"), ("max", "x")):
            values = [r[f"wait_{stat}_ms"] for r in these]
            axis.scatter(values, names, marker=marker, label=stat)
        axis.set_xscale("log")
        axis.set_title(f"{procs} processes, hold {hold:g} ms")
        axis.set_xlabel("wait, ms (log)")
        axis.invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=4, fontsize=9)
    fig.suptitle("Redis under contention: from asking to being granted (lower is better)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return _save(fig, "bench-wait.png")


def owner_changes(redis: dict[str, Any]) -> Path:
    rows = redis["contended"]
    settings = sorted({(r["procs"], r["hold_ms"]) for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axis = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(settings)
    for i, (procs, hold) in enumerate(settings):
        values = [
            next(
                r["owner_changes_per_1000"]
                for r in rows
                if (r["impl"], r["procs"], r["hold_ms"]) == (impl, procs, hold)
            )
            for impl in impls
        ]
        axis.bar(
            [x + i * width for x in range(len(impls))],
            values,
            width,
            label=f"{procs} procs, hold {hold:g} ms",
        )
    axis.set_xticks([x + width * (len(settings) - 1) / 2 for x in range(len(impls))], impls)
    axis.set_ylabel("owner changes per 1,000 acquisitions")
    axis.set_ylim(0, 1000)
    axis.legend(fontsize=8, ncols=2)
    axis.set_title("Redis under contention: how often the lock changed hands (1,000: every time)")
    fig.tight_layout()
    return _save(fig, "bench-owner-changes.png")


def watchdog(before: dict[str, Any], after: dict[str, Any]) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), width_ratios=[6, 3])
    cases = ["keep", "overload_ttl2", "overload_ttl5"]
    labels = [f"{after[c]['leases']:,} at ttl {after[c]['ttl']:g} s" for c in cases]
    width = 0.38
    for offset, (label, data, color) in enumerate(
        (("before (one call a lease)", before, "#888"), ("after (batched)", after, "#3b6ea5"))
    ):
        kept = [100 * data[c]["kept"] / data[c]["leases"] for c in cases]
        xs = [x + offset * width for x in range(len(cases))]
        left.bar(xs, kept, width, label=label, color=color)
        for x, value in zip(xs, kept, strict=True):
            left.text(x, value, f"{value:.0f}%", ha="center", va="bottom", fontsize=8)
    left.set_xticks([x + width / 2 for x in range(len(cases))], labels)
    left.set_ylabel("leases kept, % (higher is better)")
    left.set_ylim(0, 115)
    left.legend(fontsize=8, loc="center")
    left.set_title("Leases one process kept through 60 s")
    names = ["floor", "before", "after"]
    cpu = [100 * after["floor"]["cpu"], 100 * before["keep"]["cpu"], 100 * after["keep"]["cpu"]]
    right.barh(names, cpu, color=["#888", "#bbb", "#3b6ea5"])
    right.invert_yaxis()
    right.axvline(25, color="#a33", linewidth=0.8, linestyle="--")
    for y, value in enumerate(cpu):
        right.text(value, y, f" {value:.1f}%", va="center", fontsize=9)
    right.set_xlim(0, max(max(cpu), 25) * 1.3)
    right.set_title("CPU, % of a core (target: under 25)")
    keep = after["keep"]
    fig.suptitle(f"{keep['leases']:,} Redis leases at ttl {keep['ttl']:g} s in one process")
    fig.tight_layout()
    return _save(fig, "bench-watchdog.png")


def async_waiters(data: dict[str, Any]) -> Path:
    runs = data["runs"]
    names = [
        r["impl"] if r["finished"] else f"{r['impl']}\n(stopped: {r['served']:,} served)"
        for r in runs
    ]
    panels = [
        ("wall time, s (log)", [r["wall_s"] for r in runs], True),
        ("CPU time of the process, s (log)", [r["cpu_s"] for r in runs], True),
        ("RSS growth per waiter, KiB", [
            (r["rss_peak_kib"] - r["rss_before_kib"]) / r["waiters"] for r in runs
        ], False),
        ("Redis commands per waiter", [r["redis_commands_per_waiter"] for r in runs], False),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.4), sharey=True)
    for axis, (title, values, log) in zip(axes, panels, strict=True):
        colors = ["#888" if n == "asyncio.Lock" else "#3b6ea5" for n in names]
        axis.barh(names, values, color=colors)
        if log:
            axis.set_xscale("log")
        axis.set_title(title, fontsize=10)
        for y, value in enumerate(values):
            axis.text(value, y, f" {value:,.2f}", va="center", fontsize=8)
        axis.set_xlim(right=max(values) * (8 if log else 1.45))
    axes[0].invert_yaxis()
    fig.suptitle(
        f"{runs[0]['waiters']:,} asyncio waiters on one lock, one process (lower is better)"
    )
    fig.tight_layout()
    return _save(fig, "bench-async-waiters.png")


def _save(fig: Any, name: str) -> Path:
    path = OUT / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    redis, etcd = _load("redis_locks.json"), _load("etcd_locks.json")
    waiters = _load("async_waiters.json")
    for path in (
        uncontended(redis, etcd),
        waits(redis),
        owner_changes(redis),
        async_waiters(waiters),
        watchdog(_load("watchdog_before.json"), _load("watchdog.json")),
    ):
        print(path.relative_to(ROOT))


if __name__ == "__main__":
    main()
