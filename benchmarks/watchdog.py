"""The watchdog at scale: one process holding many Redis leases.

    .venv/bin/python benchmarks/watchdog.py                     # about 6 minutes
    .venv/bin/python benchmarks/watchdog.py --leases 20000 --seconds 20

Starts its own redis-server. Each case runs in a new process, which takes its
leases first and is then watched for ``--seconds`` while its watchdog keeps
them; what it used in that window is the figure:

- keep:     ``--leases`` leases at ttl ``--ttl`` (100,000 at 30 s by default),
            held through the public API (``locks["default"].acquire``). The
            target: all kept, under 25 % of a core.
- floor:    the same number of keys kept alive by the cheapest loop Python can
            run: every ttl/3, pipelined ``PEXPIRE`` in batches of 1,000, with
            no owner check and no bookkeeping. Ours is reported as a ratio to it.
- overload: more renewals than one process can send (``--overload`` leases
            at ttl 2 s, 5 s by default): how many leases are lost, and
            whether the lag was reported (``watchdog_lagging``) once.

A lease is kept if its handle was never marked lost (a handle marked lost
while its renewal was in flight may still have its key on the server, until
its TTL ends: such keys are counted in the JSON's ``on_server``, not as kept).
CPU is the process's user + system time over the window (its main thread
sleeps), as a share of one core; redis-server's own CPU is given beside it.

To see where a case spends its time, attach py-spy to its process once the
fill is done (the case's process is a child of this script):

    .venv/bin/py-spy record --gil -r 200 -d 25 -f raw -o /tmp/watchdog.raw -p PID
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import table  # noqa: E402

SETTINGS = "benchmarks.listing_settings"


def server_cpu(pid: int) -> float:
    """redis-server's user + system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def case_ours(count: int, ttl: float, seconds: float, server_pid: int) -> dict[str, Any]:
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    import django

    django.setup()
    from django_dlock import locks, signals

    lost: list[str] = []
    lagging: list[dict[str, Any]] = []
    signals.lock_lost.connect(lambda sender, name, **kw: lost.append(name), weak=False)
    lag_signal = getattr(signals, "watchdog_lagging", None)
    if lag_signal is not None:
        lag_signal.connect(lambda sender, **kw: lagging.append(kw), weak=False)
    log_lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "watchdog is falling behind" in record.getMessage():
                log_lines.append(record.getMessage())

    logging.getLogger("django_dlock").addHandler(Collect())
    logging.getLogger("django_dlock").setLevel(logging.INFO)
    backend = locks["default"]
    started = time.monotonic()
    held = [backend.acquire(f"job:{i:07d}", ttl=ttl) for i in range(count)]
    fill = time.monotonic() - started
    cpu0, srv0, wall0 = own_cpu(), server_cpu(server_pid), time.monotonic()
    time.sleep(seconds)
    cpu1, srv1, wall1 = own_cpu(), server_cpu(server_pid), time.monotonic()
    kept_locally = sum(1 for h in held if not h.lost)
    on_server = len(backend.list("job:"))
    result = {
        "leases": count,
        "ttl": ttl,
        "fill_s": round(fill, 1),
        "cpu": (cpu1 - cpu0) / (wall1 - wall0),
        "server_cpu": (srv1 - srv0) / (wall1 - wall0),
        "kept": kept_locally,
        "on_server": on_server,
        "lost_signals": len(lost),
        "lagging_signals": len(lagging),
        "lag_log_lines": len(log_lines),
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    return result


def case_floor(
    url: str, count: int, ttl: float, seconds: float, server_pid: int
) -> dict[str, Any]:
    import redis

    client = redis.Redis.from_url(url)
    keys = [f"floor:{i:07d}" for i in range(count)]
    ttl_ms = int(ttl * 1000)
    for start in range(0, count, 1000):
        pipe = client.pipeline(transaction=False)
        for key in keys[start : start + 1000]:
            pipe.set(key, "owner:1:0:{}", px=ttl_ms)
        pipe.execute()
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl / 3):
            for start in range(0, count, 1000):
                pipe = client.pipeline(transaction=False)
                for key in keys[start : start + 1000]:
                    pipe.pexpire(key, ttl_ms)
                pipe.execute()

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    cpu0, srv0, wall0 = own_cpu(), server_cpu(server_pid), time.monotonic()
    time.sleep(seconds)
    cpu1, srv1, wall1 = own_cpu(), server_cpu(server_pid), time.monotonic()
    stop.set()
    thread.join()
    kept = sum(client.exists(*keys[i : i + 1000]) for i in range(0, count, 1000))
    client.flushall()
    return {
        "leases": count,
        "ttl": ttl,
        "cpu": (cpu1 - cpu0) / (wall1 - wall0),
        "server_cpu": (srv1 - srv0) / (wall1 - wall0),
        "kept": kept,
        "on_server": kept,
    }


def run_case(url: str, pid: int, *args: str) -> dict[str, Any]:
    env = {**os.environ, "DLOCK_BENCH_REDIS_URL": url, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, __file__, "--case", *args, "--url", url, "--server-pid", str(pid)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=3600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def flush(port: int) -> None:
    subprocess.run(["redis-cli", "-p", str(port), "flushall"], check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=100_000)
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--overload", type=int, default=100_000, help="leases at ttl 2 s and 5 s")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--case", choices=["ours", "floor"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.case == "ours":
        print(json.dumps(case_ours(args.leases, args.ttl, args.seconds, args.server_pid)))
        return
    if args.case == "floor":
        print(
            json.dumps(case_floor(args.url, args.leases, args.ttl, args.seconds, args.server_pid))
        )
        return

    from tests.servers import RedisServer, free_port

    server = RedisServer(free_port()).start()
    try:
        assert server.process is not None
        url, pid = server.url, server.process.pid
        common = ["--seconds", str(args.seconds)]
        keep = ["--leases", str(args.leases), "--ttl", str(args.ttl), *common]
        rows = [["case", "leases", "ttl s", "kept", "cpu % core", "x floor", "redis cpu %",
                 "lost signals", "lag reports"]]  # fmt: skip
        results: dict[str, Any] = {}
        floor = results["floor"] = run_case(url, pid, "floor", *keep)
        flush(server.port)
        ours = results["keep"] = run_case(url, pid, "ours", *keep)
        flush(server.port)
        for name, r in (("floor", floor), ("ours", ours)):
            rows.append(
                [
                    name,
                    f"{r['leases']:,}",
                    f"{r['ttl']:g}",
                    f"{r['kept']:,}",
                    f"{100 * r['cpu']:.1f}",
                    f"{r['cpu'] / floor['cpu']:.2f}",
                    f"{100 * r['server_cpu']:.1f}",
                    str(r.get("lost_signals", "-")),
                    str(r.get("lagging_signals", "-")),
                ]
            )
        for ttl in (2.0, 5.0):
            key = f"overload_ttl{ttl:g}"
            r = results[key] = run_case(
                url, pid, "ours", "--leases", str(args.overload), "--ttl", str(ttl), *common
            )
            flush(server.port)
            rows.append(
                [
                    f"overload {ttl:g}s",
                    f"{r['leases']:,}",
                    f"{r['ttl']:g}",
                    f"{r['kept']:,}",
                    f"{100 * r['cpu']:.1f}",
                    "-",
                    f"{100 * r['server_cpu']:.1f}",
                    str(r["lost_signals"]),
                    f"{r['lagging_signals']} signal(s), {r['lag_log_lines']} log line(s)",
                ]
            )
        print(
            f"One process holding Redis leases, watched for {args.seconds:g} s after taking them;"
            " cpu is the process's share of one core in that window"
        )
        print(table(rows))
        print(f"fill: {ours['fill_s']} s for {ours['leases']:,} leases; peak RSS "
              f"{ours['rss_mib']:.0f} MiB; Python {sys.version.split()[0]}; "
              f"{os.cpu_count()} cores")  # fmt: skip
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        server.stop()
        server.cleanup()


if __name__ == "__main__":
    main()
