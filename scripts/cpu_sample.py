"""CPU-seconds the whole machine spent while a command ran, and by which processes.

    python3 scripts/cpu_sample.py -- .venv/bin/python -m pytest -n 2 --dist load

Samples /proc once a second (Linux): the machine's busy time from /proc/stat,
exact, and each process's user+system time by a label taken from its command
line (etcd, redis-server, the multi-process tests' workers, ...). A process
that lives less than a second may be missed by the per-process part, never by
the machine's total. Prints both when the command ends; exits with its status.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")
LABELS = (
    "etcd", "redis-server", "chromium", "uvicorn", "celery", "mp_worker",
    "django_dlock.testing", "postgres", "mariadbd", "beam", "manage.py", "pytest",
)  # fmt: skip


def label(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for known in LABELS:
        if known in command:
            return known
    return (command.split(" ")[0].rsplit("/", 1)[-1] or "?")[:30]


def machine() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]  # all, idle + iowait


def main() -> int:
    command = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else sys.argv[1:]
    if not command:
        print(__doc__)
        return 2
    seen: dict[tuple[str, str], list[Any]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                ticks, key = int(fields[11]) + int(fields[12]), (pid, fields[19])
                if key in seen:
                    seen[key][2] = ticks
                elif (name := label(pid)) is not None:
                    seen[key] = [name, ticks, ticks]
            done.wait(1)

    total0, idle0 = machine()
    started = time.monotonic()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    status = subprocess.call(command)
    done.set()
    sampler.join()
    wall = time.monotonic() - started
    total1, idle1 = machine()
    busy = ((total1 - total0) - (idle1 - idle0)) / HZ
    by_label: collections.Counter[str] = collections.Counter()
    for name, first, last in seen.values():
        by_label[name] += (last - first) / HZ
    print(
        f"\nwall {wall:.0f} s; machine busy {busy:.0f} CPU-s of {(os.cpu_count() or 1) * wall:.0f}"
    )
    for name, seconds in by_label.most_common(15):
        if seconds < 0.1:
            break
        print(f"{seconds:8.1f}  {name}")
    return status


if __name__ == "__main__":
    sys.exit(main())
