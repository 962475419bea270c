"""``manage.py dlock_demo``: several processes contending for named locks.

Runs on whatever ``DLOCK_BACKENDS`` says; the test project leaves it unset, so
this is the zero-config default: the database backend on SQLite, no servers.

1. Worker processes take turns on a few shared names and print who held what
   with which fencing token; the parent checks that each name's tokens
   strictly increase in the order the holders got them.
2. Background processes hold locks while the parent shows a ``timeout=0``
   attempt failing and prints ``manage.py locks`` and ``locks show``.
3. One holder is killed with SIGKILL; its lease expires and the parent takes
   the lock over: no stuck lock.
4. A real Celery worker (prefork, on kombu's filesystem transport: no broker
   server) gets many duplicate ``@locked_task`` calls; the parent shows the
   held locks while the first calls run, then how many ran and were skipped.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from io import StringIO
from pathlib import Path
from typing import Any

from celery.exceptions import TaskRevokedError
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from django_dlock import LockTimeout, lock, locks

NAMES = ["report:daily", "invoice:42", "invoice:43"]


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class Command(BaseCommand):
    help = "Show processes contending for named locks on the configured default backend."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--workers", type=int, default=4)
        parser.add_argument("--rounds", type=int, default=3)
        parser.add_argument("--duplicates", type=int, default=8, help="calls per Celery key")
        parser.add_argument("--no-celery", action="store_true", help="skip the Celery act")
        parser.add_argument("--worker", type=int, help=argparse_hidden())
        parser.add_argument("--hold", help=argparse_hidden())
        parser.add_argument("--ttl", type=float, default=10.0, help=argparse_hidden())
        parser.add_argument("--note", default="", help=argparse_hidden())

    def handle(self, *args: Any, **options: Any) -> None:
        if options["worker"] is not None:
            return self.worker(options["worker"], options["rounds"])
        if options["hold"]:
            return self.holder(options["hold"], options["ttl"], options["note"])
        self.started = time.monotonic()
        backend = locks["default"]
        where = f"{connection.vendor} {connection.settings_dict['NAME']}"
        self.say(
            self.style.MIGRATE_HEADING(
                f"django-dlock demo: {type(backend).__name__} on {where}, no servers"
            )
        )
        self.contend(options["workers"], options["rounds"])
        self.table_while_held()
        self.killed_holder()
        if not options["no_celery"]:
            self.celery(options["duplicates"])

    # --- child processes ------------------------------------------------------------

    def worker(self, index: int, rounds: int) -> None:
        names = NAMES[index % len(NAMES) :] + NAMES[: index % len(NAMES)]
        for _ in range(rounds):
            for name in names:
                asked = time.monotonic()
                with lock(name, ttl=10, timeout=60, metadata={"demo": f"worker-{index}"}) as held:
                    emit(
                        {
                            "worker": index,
                            "pid": os.getpid(),
                            "name": name,
                            "token": held.token,
                            "waited_ms": round((time.monotonic() - asked) * 1000),
                        }
                    )
                    time.sleep(random.uniform(0.02, 0.06))

    def holder(self, name: str, ttl: float, note: str) -> None:
        with lock(name, ttl=ttl, timeout=30, metadata={"note": note}) as held:
            emit({"ready": name, "token": held.token, "pid": os.getpid()})
            sys.stdin.read()  # hold until the parent closes our stdin

    def spawn(self, *args: str, stdin: bool = False) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "dlock_demo", *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            text=True,
        )

    # --- the three acts -------------------------------------------------------------

    def contend(self, workers: int, rounds: int) -> None:
        self.say(
            f"\n1. {workers} worker processes x {rounds} rounds over {', '.join(NAMES)}; "
            "each line is printed while its lock is held."
        )
        procs = [self.spawn("--worker", str(i), "--rounds", str(rounds)) for i in range(workers)]
        events: list[dict[str, Any]] = []
        mutex = threading.Lock()

        def pump(proc: subprocess.Popen[str]) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                event = json.loads(line)
                with mutex:
                    events.append(event)
                    self.say(
                        f"  {self.clock()}  worker-{event['worker']} (pid {event['pid']}) holds "
                        f"{event['name']:<13} token {event['token']}  "
                        f"waited {event['waited_ms']:>4} ms"
                    )

        pumps = [threading.Thread(target=pump, args=(p,)) for p in procs]
        for t in pumps:
            t.start()
        for t in pumps:
            t.join()
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"worker {p.args} failed")
        by_name: dict[str, list[int]] = defaultdict(list)
        for event in events:
            by_name[event["name"]].append(event["token"])
        for name, tokens in by_name.items():
            increasing = all(a < b for a, b in itertools.pairwise(tokens))
            verdict = self.style.SUCCESS("yes") if increasing else self.style.ERROR("NO")
            self.say(
                f"  {name:<13} {len(tokens)} holders, tokens strictly increasing in "
                f"acquisition order: {verdict}"
            )

    def table_while_held(self) -> None:
        self.say("\n2. Two background processes hold locks:")
        holders = [
            self.spawn("--hold", "report:daily", "--note", "nightly report", stdin=True),
            self.spawn("--hold", "invoice:42", "--note", "regenerating PDF", stdin=True),
        ]
        for h in holders:
            assert h.stdout is not None
            json.loads(h.stdout.readline())
        try:
            with lock("report:daily", timeout=0):
                self.say(self.style.ERROR("  acquired a lock that another process holds!"))
        except LockTimeout as e:
            self.say(f"  timeout=0 on a held lock -> LockTimeout: {e}")
        self.say("  $ manage.py locks")
        self.print_table()
        self.say("  $ manage.py locks show report:daily")
        self.print_table("show", "report:daily")
        for h in holders:
            assert h.stdin is not None
            h.stdin.close()
            h.wait()
        self.say("  after the holders released, $ manage.py locks")
        self.print_table()

    def killed_holder(self) -> None:
        self.say("\n3. A holder with ttl=2 is killed with SIGKILL while holding 'invoice:43':")
        victim = self.spawn(
            "--hold", "invoice:43", "--ttl", "2", "--note", "about to die", stdin=True
        )
        assert victim.stdout is not None
        ready = json.loads(victim.stdout.readline())
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        self.say(f"  killed pid {ready['pid']} holding token {ready['token']}")
        asked = time.monotonic()
        with lock("invoice:43", timeout=30) as held:
            waited = time.monotonic() - asked
            self.say(
                f"  the lease expired by the database clock; acquired after {waited:.1f} s "
                f"with token {held.token} (> {ready['token']}: "
                f"{self.style.SUCCESS('yes') if held.token > ready['token'] else 'NO'})"
            )

    def celery(self, duplicates: int) -> None:
        from demo.tasks import build_report, sync_account

        accounts = [1, 2, 3]
        self.say(
            f"\n4. A Celery worker (prefork, 4 processes, filesystem broker) gets "
            f"{duplicates} duplicate calls for each of accounts {accounts}:"
        )
        data = Path(settings.CELERY_DATA_DIR)
        shutil.rmtree(data, ignore_errors=True)
        (data / "queue").mkdir(parents=True)
        (data / "results").mkdir()
        logfile = data / "worker.log"
        worker = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "testproject", "worker",
                "-P", "prefork", "-c", "4", "-n", "demo@%h", "-l", "INFO",
                "--logfile", str(logfile),
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            ],
            cwd=settings.BASE_DIR,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not (logfile.exists() and " ready." in logfile.read_text()):
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the Celery worker did not start; see {logfile}")
                time.sleep(0.1)
            self.say(f"  worker {worker.pid} ready")
            calls = [(a, build_report.delay(a)) for _ in range(duplicates) for a in accounts]
            time.sleep(1.0)
            self.say("  while the first calls run, $ manage.py locks")
            self.print_table()
            ran: dict[int, list[int]] = defaultdict(list)
            skipped: dict[int, int] = defaultdict(int)
            for account, result in calls:
                # A skipped message is recorded as REVOKED: get() raises TaskRevokedError.
                value = result.get(timeout=60, propagate=False)
                if isinstance(value, TaskRevokedError):
                    skipped[account] += 1
                else:
                    ran[account].append(value["token"])
            for account in accounts:
                verdict = self.style.SUCCESS("ok") if len(ran[account]) == 1 else "duplicates!"
                self.say(
                    f"  report:{account}  ran {len(ran[account])} (token "
                    f"{', '.join(map(str, ran[account]))}), skipped {skipped[account]}  "
                    f"{verdict}"
                )
            queued = [(a, sync_account.delay(a)) for _ in range(duplicates) for a in accounts]
            for account in accounts:
                # A refused call returns the AsyncResult of the message that holds its key.
                sent = list(
                    {r.id: r for a, r in queued if a == account and r is not None}.values()
                )
                for result in sent:
                    result.get(timeout=60)
                self.say(
                    f"  sync:{account}  scope='queue': {duplicates} calls enqueued "
                    f"{len(sent)} message(s), {duplicates - len(sent)} refused at enqueue"
                )
        finally:
            worker.terminate()
            worker.wait(timeout=60)
        self.say("  worker stopped, $ manage.py locks")
        self.print_table()

    # --- output ---------------------------------------------------------------------

    def print_table(self, *args: str) -> None:
        """What ``manage.py locks`` prints (the same command, run here), indented."""
        out = StringIO()
        try:
            call_command("locks", *args, stdout=out, no_color=True)
        except CommandError as e:
            out.write(f"{e}\n")
        for line in out.getvalue().splitlines():
            self.say(f"  {line}" if line else "")

    def clock(self) -> str:
        return f"+{time.monotonic() - self.started:6.3f}s"

    def say(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS
