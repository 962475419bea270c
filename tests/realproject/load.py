"""Drive the realistic project under load and count what the locks let slip.

    PYTHONPATH=$PWD .venv/bin/python tests/realproject/load.py [--requests 40] [--json out.json]

For each cell of the matrix (ATOMIC_REQUESTS on and off x the database and
Redis lock backends) it starts the project under uvicorn (ASGI: sync views
each in a thread of their own, async views on the event loop) and a Celery
worker (prefork, acks_late) on the RabbitMQ broker at 127.0.0.1:5672, then
sends ``--requests`` concurrent increments down each path and counts:

- lost updates: the increments answered 200 (and the warm-up's one) minus
  the value left in the database;
- 5xx answers, and 423/429 (a lock not obtained within the view's 10 s wait);
- connections left open: the idle PostgreSQL connections of the web server
  after the load (it runs with CONN_MAX_AGE=0, as Django says to under ASGI:
  each request closes its own, so none should be left), and those of the
  worker beyond one per worker process (CONN_MAX_AGE=60).

With ``--project-tests`` (the default: ``run``) it first runs the project's
own ``manage.py test`` on PostgreSQL, which must exit 0 and leave no test
database behind.

It creates its own databases (``realproj_<pid>``, ``realproj_<pid>_ledger``),
redis-server and queue, and removes them at the end. Prints a table; exits 1
on any loss, leak, 5xx or failed project test.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

PROJECT = Path(__file__).resolve().parent
ROOT = PROJECT.parent.parent
sys.path.insert(0, str(ROOT))

from tests.servers import RedisServer, free_port, port_open, wait_for  # noqa: E402

PG = {
    "host": os.environ.get("REALPROJ_PG_HOST", "127.0.0.1"),
    "port": int(os.environ.get("REALPROJ_PG_PORT", "5432")),
    "user": os.environ.get("REALPROJ_PG_USER", "postgres"),
}
BROKER = os.environ.get("REALPROJ_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")


@dataclass(frozen=True)
class Path_:
    """One way into the project: its URL, what it exercises, and where its count lands."""

    name: str
    what: str
    url: str  # with {name}
    database: str  # "default" or "ledger"
    final: str  # SQL giving the value for %s (the row's name)


PATHS = [
    Path_("view-fn", "sync @lock_view", "/counters/{name}/fn/", "default",
          "SELECT value FROM inventory_counter WHERE name = %s"),
    Path_("view-cbv", "sync LockRequiredMixin", "/counters/{name}/cbv/", "default",
          "SELECT value FROM inventory_counter WHERE name = %s"),
    Path_("async-fn", "async @lock_view", "/counters/{name}/async-fn/", "default",
          "SELECT value FROM inventory_counter WHERE name = %s"),
    Path_("async-cbv", "async LockRequiredMixin", "/counters/{name}/async-cbv/", "default",
          "SELECT value FROM inventory_counter WHERE name = %s"),
    Path_("save-book", "@lock_view + fenced save, child of a FencedModel",
          "/books/{name}/sell/", "default",
          "SELECT b.sold FROM inventory_book b JOIN inventory_item i ON b.item_ptr_id = i.id"
          " WHERE i.name = %s"),
    Path_("save-warehouse", "@lock_view + fenced save, FencedModel child of a plain model",
          "/warehouses/{name}/restock/", "default",
          "SELECT w.stock FROM inventory_warehouse w JOIN inventory_place p"
          " ON w.place_ptr_id = p.id WHERE p.name = %s"),
    Path_("ledger-2db", "release_on_commit on the second database",
          "/accounts/{name}/credit/", "ledger",
          "SELECT balance FROM inventory_account WHERE name = %s"),
    Path_("celery-task", "view enqueues on commit, @locked_task increments",
          "/tallies/{name}/enqueue/", "default",
          "SELECT value FROM inventory_tally WHERE name = %s"),
]  # fmt: skip
DELETE = "delete"
WORKER_PROCESSES = 3


@dataclass
class PathResult:
    path: str
    what: str
    requests: int = 0
    ok: int = 0
    expected: int = 0
    final: int | None = None
    lost: int = 0
    server_errors: int = 0
    refused: int = 0
    other: int = 0
    notes: list[str] = field(default_factory=list)

    def failures(self, cell: str) -> list[str]:
        where = f"{cell}, path {self.path} ({self.what})"
        out = []
        if self.lost and self.path == DELETE:
            out.append(f"{where}: {self.lost} of {self.expected} books left undeleted")
        elif self.lost:
            out.append(
                f"{where}: {self.lost} of {self.expected} updates lost"
                f" (final {self.final}, expected {self.expected})"
                if self.lost > 0
                else f"{where}: {-self.lost} updates more than answered"
                f" (final {self.final}, expected {self.expected})"
            )
        if self.server_errors:
            out.append(f"{where}: {self.server_errors} of {self.requests} answers were 5xx")
        if self.refused:
            out.append(
                f"{where}: {self.refused} of {self.requests} answers were 423/429"
                " (lock not obtained within the view's wait)"
            )
        if self.other:
            out.append(f"{where}: {self.other} of {self.requests} requests got no 2xx answer")
        out.extend(f"{where}: {note}" for note in self.notes)
        return out


@dataclass
class CellResult:
    atomic: str
    backend: str
    paths: list[PathResult] = field(default_factory=list)
    connections_before: dict[str, int] = field(default_factory=dict)
    connections_after: dict[str, int] = field(default_factory=dict)
    leftover: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"ATOMIC_REQUESTS={self.atomic}, lock backend {self.backend}"


def admin_connect(dbname: str = "postgres") -> psycopg.Connection[Any]:
    """The harness's own connection; connections leaked by the project can fill the server."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return psycopg.connect(dbname=dbname, autocommit=True, **PG)  # type: ignore[arg-type]
        except psycopg.OperationalError as e:
            if "too many clients" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def drop_database(name: str) -> None:
    with admin_connect() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def database_exists(name: str) -> bool:
    with admin_connect() as conn:
        return (
            conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
            is not None
        )


def base_env(databases: dict[str, str]) -> dict[str, str]:
    python_path = [str(ROOT), str(PROJECT)]
    if os.environ.get("PYTHONPATH"):
        python_path.append(os.environ["PYTHONPATH"])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(python_path),
        "DJANGO_SETTINGS_MODULE": "realproject.settings",
        "REALPROJ_DB": databases["default"],
        "REALPROJ_LEDGER_DB": databases["ledger"],
        "REALPROJ_PG_HOST": PG["host"],  # type: ignore[dict-item]
        "REALPROJ_PG_PORT": str(PG["port"]),
        "REALPROJ_PG_USER": PG["user"],  # type: ignore[dict-item]
        "CELERY_BROKER_URL": BROKER,
    }


def manage(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROJECT / "manage.py"), *args],
        env=env, cwd=PROJECT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def run_project_tests(tag: str) -> list[str]:
    """``manage.py test`` on PostgreSQL: exit 0 and no test database left behind."""
    databases = {"default": f"realproj_{tag}", "ledger": f"realproj_{tag}_ledger"}
    env = {**base_env(databases), "REALPROJ_APP_NAME": "realproj-tests"}
    failures = []
    try:
        done = manage(env, "test", "--noinput", timeout=600)
        lines = (done.stdout + done.stderr).strip().splitlines()
        summary = [
            line for line in lines
            if line.startswith(("ERROR: ", "FAIL: ", "Ran ", "FAILED", "OK"))
        ]  # fmt: skip
        tail = "\n".join([*summary, *lines[-2:]])
        if done.returncode != 0:
            failures.append(f"manage.py test exited {done.returncode}; last lines:\n{tail}")
        print(f"manage.py test: exit {done.returncode}\n{tail}\n", flush=True)
    finally:
        for alias, name in databases.items():
            test_name = f"test_{name}"
            if database_exists(test_name):
                failures.append(
                    f"manage.py test left its test database {test_name!r} ({alias}) behind"
                )
                drop_database(test_name)
    return failures


def post(port: int, url: str, timeout: float = 60) -> tuple[int, str]:
    """(status, body); status 0 when no answer came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", url, headers={"Connection": "close", "Content-Length": "0"})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        return 0, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def count_answers(result: PathResult, answers: list[tuple[int, str]]) -> None:
    for status, _ in answers:
        result.requests += 1
        if 200 <= status < 300:
            result.ok += 1
        elif status >= 500:
            result.server_errors += 1
        elif status in (423, 429):
            result.refused += 1
        else:
            result.other += 1


def concurrently(port: int, urls: list[str], workers: int) -> list[tuple[int, str]]:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda url: post(port, url), urls))


def idle_connections(databases: dict[str, str], roles: list[str]) -> dict[str, int]:
    with admin_connect() as conn:
        rows = conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity"
            " WHERE datname = ANY(%s) AND application_name = ANY(%s) AND state LIKE 'idle%%'"
            " GROUP BY 1",
            [list(databases.values()), roles],
        ).fetchall()
    found = dict(rows)
    return {role: int(found.get(role, 0)) for role in roles}


def settled_idle(
    databases: dict[str, str], roles: list[str], seconds: float = 3
) -> dict[str, int]:
    """Idle connections once their count stays the same for a second (at most ``seconds``)."""
    deadline = time.monotonic() + seconds
    last = idle_connections(databases, roles)
    while time.monotonic() < deadline:
        time.sleep(1)
        now = idle_connections(databases, roles)
        if now == last:
            break
        last = now
    return last


def value(databases: dict[str, str], database: str, sql: str, name: str) -> int | None:
    with admin_connect(databases[database]) as conn:
        row = conn.execute(sql, [name]).fetchone()
    return None if row is None else int(row[0])


class Processes:
    """The web server and the worker of one cell, stopped on exit."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> Path:
        log = self.logdir / f"{name}.log"
        with open(log, "wb") as out:
            self.started.append(
                subprocess.Popen(
                    args,
                    env=env,
                    cwd=PROJECT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return log

    def stop(self) -> None:
        for process in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=20)
        self.started.clear()


def delete_queue(queue: str) -> None:
    from kombu import Connection

    with contextlib.suppress(Exception), Connection(BROKER, connect_timeout=5) as conn:
        conn.default_channel.queue_delete(queue)


def wait_until(predicate: Callable[[], bool], deadline: float) -> None:
    """Until ``predicate()``, at most ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while time.monotonic() < end and not predicate():
        time.sleep(0.25)


def run_cell(
    atomic: str,
    backend: str,
    databases: dict[str, str],
    redis_url: str | None,
    requests: int,
    concurrency: int,
    logdir: Path,
    paths: list[str],
) -> CellResult:
    cell = CellResult(atomic, backend)
    tag = f"{atomic}-{backend}"
    queue = f"realproj-{os.getpid()}-{tag}"
    web_role, worker_role = f"realproj-web-{tag}", f"realproj-worker-{tag}"
    env = {
        **base_env(databases),
        "REALPROJ_ATOMIC_REQUESTS": "1" if atomic == "on" else "0",
        "REALPROJ_LOCK_BACKEND": backend,
        "REALPROJ_REDIS_URL": redis_url or "",
        "REALPROJ_QUEUE": queue,
    }
    processes = Processes(logdir)
    port = free_port()
    try:
        worker_log = processes.start(
            f"worker-{tag}",
            [
                sys.executable, "-m", "celery", "-A", "realproject", "worker",
                "-P", "prefork", "-c", str(WORKER_PROCESSES), "-Q", queue,
                "-n", f"{queue}@%h", "-l", "INFO",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            ],
            {**env, "REALPROJ_APP_NAME": worker_role, "REALPROJ_CONN_MAX_AGE": "60"},
        )  # fmt: skip
        web_log = processes.start(
            f"web-{tag}",
            [
                sys.executable, "-m", "uvicorn", "realproject.asgi:application",
                "--host", "127.0.0.1", "--port", str(port), "--lifespan", "off",
                "--no-access-log", "--log-level", "warning",
            ],
            # Django: "When using ASGI, persistent connections should be
            # disabled" (each request runs in a thread of its own).
            {**env, "REALPROJ_APP_NAME": web_role, "REALPROJ_CONN_MAX_AGE": "0"},
        )  # fmt: skip
        wait_for(lambda: port_open("127.0.0.1", port), 60, f"uvicorn (log: {web_log})")
        wait_for(
            lambda: " ready." in worker_log.read_text(errors="replace"),
            90,
            f"celery worker (log: {worker_log})",
        )

        # Warm-up: one request down each path, one at a time, which creates
        # the rows; then the connections every process keeps are open.
        results: dict[str, PathResult] = {}
        selected = [p for p in PATHS if p.name in paths]
        deleted_names = (
            [f"{DELETE}-{tag}-{i}" for i in range(max(1, requests // 2))]
            if DELETE in paths
            else []
        )
        for p in selected:
            result = results[p.name] = PathResult(p.name, p.what)
            name = f"{p.name}-{tag}"
            if p.name == "save-book":
                count_answers(result, [post(port, f"/books/{name}/stock/")])
                result.ok = 0  # stocking is no increment
            answer = post(port, p.url.format(name=name))
            count_answers(result, [answer])
            result.expected = result.ok
            if answer[0] != 200:
                result.notes.append(f"the warm-up request answered {answer[0]}")
        results[DELETE] = PathResult(DELETE, "delete under the lock")
        for name in deleted_names:
            count_answers(results[DELETE], [post(port, f"/books/{name}/stock/")])
        results[DELETE].ok = 0
        for task in selected:
            if task.name == "celery-task":
                wait_until(
                    lambda task=task: (
                        (value(databases, "default", task.final, f"celery-task-{tag}") or 0)
                        >= results["celery-task"].expected
                    ),
                    deadline=60,
                )
        roles = [web_role, worker_role]
        cell.connections_before = settled_idle(databases, roles)

        for p in selected:
            result = results[p.name]
            name = f"{p.name}-{tag}"
            answers = concurrently(port, [p.url.format(name=name)] * requests, concurrency)
            before_ok = result.ok
            count_answers(result, answers)
            result.expected += result.ok - before_ok
            samples = sorted({b[:200] for s, b in answers if s == 0})
            result.notes.extend(f"no answer: {sample}" for sample in samples[:2])
            if p.name == "celery-task":
                expected = result.expected
                wait_until(
                    lambda p=p, name=name, expected=expected: (
                        (value(databases, p.database, p.final, name) or 0) >= expected
                    ),
                    deadline=90,
                )
            result.final = value(databases, p.database, p.final, name)
            result.lost = result.expected - (result.final or 0)
            cell.paths.append(result)

        # Deletes: two requests per book at once; each book deleted exactly once.
        if deleted_names:
            result = results[DELETE]
            answers = concurrently(
                port,
                [f"/books/{name}/discard/" for name in deleted_names for _ in range(2)],
                concurrency,
            )
            for status, body in answers:
                result.requests += 1
                if status == 200:
                    result.ok += json.loads(body).get("deleted", 0)
                elif status in (404, 409):
                    pass  # found gone, or refused by the fence: both keep the promise
                elif status >= 500:
                    result.server_errors += 1
                elif status in (423, 429):
                    result.refused += 1
                else:
                    result.other += 1
            result.expected = len(deleted_names)
            with admin_connect(databases["default"]) as conn:
                left = conn.execute(
                    "SELECT count(*) FROM inventory_item WHERE name LIKE %s", [f"{DELETE}-{tag}-%"]
                ).fetchone()
            result.final = result.expected - int(left[0]) if left else None
            if result.ok != result.expected:
                result.notes.append(
                    f"{result.ok} deletions answered for {result.expected} books deleted once each"
                )
            result.lost = result.expected - (result.final or 0)
            cell.paths.append(result)

        cell.connections_after = settled_idle(databases, roles)
        # The web server keeps none between requests (CONN_MAX_AGE=0); each
        # worker process keeps its one to "default" (CONN_MAX_AGE=60).
        allowed = {web_role: 0, worker_role: WORKER_PROCESSES}
        cell.leftover = {role: cell.connections_after[role] - allowed[role] for role in roles}
    except Exception as e:
        cell.errors.append(f"{type(e).__name__}: {e}")
    finally:
        processes.stop()
        delete_queue(queue)

    causes = server_error_causes(logdir / f"web-{tag}.log")
    for result in cell.paths:
        if result.server_errors:
            marker = "/delete-" if result.path == DELETE else f"/{result.path}-"
            found: Counter[str] = Counter()
            for (url, cause), n in causes.items():
                if marker in url:
                    found[cause] += n
            result.notes.extend(f"5xx cause ({n}x): {c}" for c, n in found.most_common())
    label = cell.label
    cell.failures = [f"{label}: {error}" for error in cell.errors]
    for result in cell.paths:
        cell.failures.extend(result.failures(label))
    for role, extra in cell.leftover.items():
        if extra > 0:
            cell.failures.append(
                f"{label}: {extra} idle PostgreSQL connection(s) of the"
                f" {role.split('-')[1]} process left open after the load"
                f" ({cell.connections_after[role]} after the load, at most"
                f" {cell.connections_after[role] - extra} expected;"
                f" {cell.connections_before[role]} after the warm-up)"
            )
    return cell


EXCEPTION_LINE = re.compile(
    r"^[A-Za-z_][\w.]*(Error|Exception|Timeout|Write|Lost|Owned|Unavailable)\b"
)


def server_error_causes(log: Path) -> Counter[tuple[str, str]]:
    """(URL, the last exception raised) of each 500 that django.request logged.

    Quoted names and numbers are blanked, so that one cause counts once.
    """
    causes: Counter[tuple[str, str]] = Counter()
    if not log.exists():
        return causes
    text = log.read_text(errors="replace")
    for block in text.split("Internal Server Error: ")[1:]:
        lines = block.splitlines()
        exceptions = [line for line in lines[1:] if EXCEPTION_LINE.match(line)]
        cause = exceptions[-1] if exceptions else "(no exception logged)"
        cause = re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'...'", cause))
        causes[(lines[0], cause[:300])] += 1
    return causes


def print_table(cells: list[CellResult]) -> None:
    header = (
        f"{'atomic':6} {'backend':7} {'path':15} {'reqs':>5} {'ok':>5} {'final':>6}"
        f" {'lost':>5} {'5xx':>4} {'423':>4} {'other':>5}"
    )
    print(header)
    print("-" * len(header))
    for cell in cells:
        for r in cell.paths:
            print(
                f"{cell.atomic:6} {cell.backend:7} {r.path:15} {r.requests:5} {r.ok:5}"
                f" {r.final if r.final is not None else '-':>6} {r.lost:5}"
                f" {r.server_errors:4} {r.refused:4} {r.other:5}"
            )
        for role, extra in cell.leftover.items():
            print(
                f"{cell.atomic:6} {cell.backend:7} idle conns {role.split('-')[1]:6}:"
                f" {cell.connections_before[role]} after warm-up,"
                f" {cell.connections_after[role]} after load,"
                f" left open {max(0, extra)}"
            )
        for error in cell.errors:
            print(f"{cell.atomic:6} {cell.backend:7} ERROR {error}")
    print()


@contextlib.contextmanager
def databases_for(tag: str) -> Iterator[dict[str, str]]:
    databases = {"default": f"realproj_{tag}", "ledger": f"realproj_{tag}_ledger"}
    for name in databases.values():
        drop_database(name)
        with admin_connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield databases
    finally:
        for name in databases.values():
            drop_database(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="per path and cell")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--backends", default="db,redis")
    parser.add_argument("--atomic", default="on,off")
    parser.add_argument(
        "--paths",
        default=",".join([*(p.name for p in PATHS), DELETE]),
        help="comma-separated, of: %(default)s",
    )
    parser.add_argument("--project-tests", choices=("run", "skip", "only"), default="run")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    if not port_open("127.0.0.1", 5672):
        print("RabbitMQ does not answer on 127.0.0.1:5672", file=sys.stderr)
        return 2
    tag = str(os.getpid())
    failures: list[str] = []
    cells: list[CellResult] = []
    if args.project_tests != "skip":
        failures.extend(run_project_tests(f"{tag}_t"))
    if args.project_tests != "only":
        backends = args.backends.split(",")
        redis = RedisServer(free_port()).start() if "redis" in backends else None
        logdir = Path(tempfile.mkdtemp(prefix="realproj-logs-"))
        try:
            with databases_for(tag) as databases:
                env = base_env(databases)
                for alias in databases:
                    done = manage(env, "migrate", "--noinput", "--database", alias)
                    if done.returncode != 0:
                        print(done.stdout + done.stderr, file=sys.stderr)
                        return 2
                for backend in backends:
                    for atomic in args.atomic.split(","):
                        started = time.monotonic()
                        cell = run_cell(
                            atomic, backend, databases, redis.url if redis else None,
                            args.requests, args.concurrency, logdir, args.paths.split(","),
                        )  # fmt: skip
                        print(
                            f"{cell.label}: {time.monotonic() - started:.1f} s,"
                            f" {len(cell.failures)} failure(s)",
                            flush=True,
                        )
                        cells.append(cell)
                        failures.extend(cell.failures)
        finally:
            if redis is not None:
                redis.cleanup()
        print(f"\nlogs: {logdir}\n")
        print_table(cells)
    for failure in failures:
        print(f"FAIL {failure}")
    if args.json:
        args.json.write_text(
            json.dumps({"cells": [asdict(c) for c in cells], "failures": failures}, indent=1)
        )
    print("OK: no loss, no leak, no 5xx" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
