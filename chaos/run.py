"""``make chaos``: every backend against every fault, checked, as one table.

For each backend this starts its own servers (redis-server, a 3-member etcd
cluster, a 3-server ZooKeeper ensemble and a standalone server; a database
of its own on the PostgreSQL and MariaDB servers; a SQLite file), three workers
(``chaos/worker.py``), and then runs one phase per fault: the fault is
injected, lasts a while, is healed, and the workers get ``TTL + RECOVERY``
seconds to recover before the next episode. The
history checker (``chaos/history.py``) then checks each phase.

    python -m chaos --seconds 600          # the full matrix, about 10 minutes
    python -m chaos --short                # CI: each fault and backend once
    python -m chaos --backends redis,etcd --faults pause,partition
    python -m chaos --short --kind semaphore   # the workers hold a semaphore (limit 1)

``--kind`` is what the workers hold: ``mutex`` (the default), ``semaphore``
(limit 1) or ``rwlock`` (the write side); the last two skip the backends
without semaphores (Redlock).

Exit status 1 if any phase has a violation, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chaos import history, nemesis
from tests.netproxy import Proxy
from tests.servers import RedisServer, free_port, start_etcd_cluster, start_zookeeper

ROOT = Path(__file__).resolve().parent.parent
#: Lease length the workers ask for, seconds (etcd grants at least 1 s).
TTL = 2.0
#: How long a worker waits for the lock before it gives up and tries again.
TIMEOUT = 5.0
#: Seconds after a heal before the next episode: the liveness window.
RECOVERY = 4.0
#: The liveness bound the checker holds each heal to: TTL + this.
SLACK = 3.0
WORKERS = 3
PG: dict[str, Any] = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}
MYSQL: dict[str, Any] = {"host": "127.0.0.1", "port": 3306, "user": "root", "password": ""}
DB = "dlock_chaos"
REGISTER_DB = "dlock_chaos_register"


@dataclass(frozen=True)
class Fault:
    name: str
    #: How long one episode lasts, seconds.
    lasts: float
    #: A holder may be paused past its lease (mutual exclusion cannot hold).
    pauses: bool = False
    #: The lock service loses its data (mutual exclusion is not promised).
    loses_data: bool = False
    network: bool = False
    #: Made by the TCP proxies between the workers and the lock service.
    proxied: bool = False
    what: str = ""


FAULTS = {
    f.name: f
    for f in (
        Fault("pause", TTL + 1, pauses=True, what="SIGSTOP the holder past its TTL, then SIGCONT"),
        Fault("kill", 0.2, what="SIGKILL the holder, respawn it"),
        Fault(
            "restart",
            1.0,
            loses_data=True,
            what="kill the server (redis-server keeps no data; ZooKeeper keeps its own), restart",
        ),
        Fault("leader", 2.0, what="kill the leader of 3 members (etcd, ZooKeeper), restart it"),
        Fault("terminate", 0.0, what="end the lock connections on the server"),
        Fault("filelock", 3.0, what="another process holds SQLite's write lock"),
        Fault("partition", 3.0, network=True, what="the lock link goes down"),
        Fault("blackhole", 3.0, network=True, what="requests run, replies are dropped"),
        Fault("loss", 4.0, network=True, what="20% of packets dropped each way"),
        Fault("latency", 4.0, network=True, what="100 ms added each way (a TCP proxy)"),
        Fault(
            "late",
            3.0,
            proxied=True,
            what="every reply held to the next 0.8 s boundary: requests run at once, "
            "their replies come late and all together",
        ),
        Fault(
            "reorder",
            4.0,
            proxied=True,
            what="every reply delayed 0-300 ms at random: replies on different "
            "connections arrive in another order than sent",
        ),
        Fault(
            "clockstep",
            3.0,
            pauses=True,
            what="SQLite's lock clock (the workers' wall clock) steps 30 s forward, then back",
        ),
    )
}
NETWORK = ("partition", "blackhole", "loss", "latency")
PROXIED = ("late", "reorder")


class Run:
    """Shared by the targets: where the workers are, and how they reach a server."""

    def __init__(self, net: nemesis.Net | None, tmp: Path) -> None:
        self.net = net
        self.tmp = tmp
        self.proxies: list[Proxy] = []

    def lock_address(self, port: int) -> tuple[str, int]:
        """How a worker reaches the lock service listening on 127.0.0.1:port."""
        if self.net is not None:
            proxy = self.net.lock_proxy(port)
            return self.net.lock_host, proxy.port
        proxy = Proxy(port)
        self.proxies.append(proxy)
        return "127.0.0.1", proxy.port

    def register_dsn(self) -> str:
        if self.net is not None:
            proxy = self.net.register_proxy(PG["port"])
            host, port = self.net.reg_host, proxy.port
        else:
            host, port = PG["host"], PG["port"]
        return f"host={host} port={port} dbname={REGISTER_DB} user={PG['user']}"

    def latency(self, seconds: float) -> None:
        if self.net is not None:
            self.net.latency(seconds)
        for proxy in self.proxies:
            proxy.latency = seconds

    def replies(self, bunch: float = 0.0, jitter: float = 0.0) -> None:
        """Hold the lock service's replies (see ``tests/netproxy.py``); no arguments: do not."""
        proxies = self.proxies + (self.net.lock_proxies() if self.net is not None else [])
        for proxy in proxies:
            proxy.bunch, proxy.jitter = bunch, jitter

    def close_proxies(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        self.proxies = []
        if self.net is not None:
            for proxy in self.net.proxies:
                proxy.close()
            self.net.proxies = []


class Target:
    """A backend under test: its servers, its settings as the workers see them, its faults."""

    name = ""
    faults: tuple[str, ...] = ("pause", "kill", *NETWORK, *PROXIED)

    def start(self, run: Run) -> None:
        raise NotImplementedError

    def worker_config(self) -> dict[str, Any]:
        """What else the workers' configuration holds for this target."""
        return {}

    def worker_settings(self, run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the lock backend's settings, DATABASES) for the workers."""
        raise NotImplementedError

    def inject(self, fault: str) -> None:
        raise NotImplementedError(fault)

    def heal(self, fault: str) -> None:
        raise NotImplementedError(fault)

    def stop(self) -> None:
        pass


class RedisTarget(Target):
    name = "redis"
    faults = ("pause", "kill", "restart", *NETWORK, *PROXIED)
    masters = 1

    def start(self, run: Run) -> None:
        self.servers = [RedisServer(free_port()).start() for _ in range(self.masters)]
        self.down: RedisServer | None = None

    def worker_settings(self, run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
        urls = []
        for server in self.servers:
            host, port = run.lock_address(server.port)
            urls.append(f"redis://{host}:{port}/0")
        options = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
        if len(urls) == 1:
            return {"BACKEND": "django_dlock.backends.redis.RedisBackend",
                    "LOCATION": urls[0], "OPTIONS": options}, {}  # fmt: skip
        return {"BACKEND": "django_dlock.backends.redis.RedlockBackend",
                "LOCATION": urls, "OPTIONS": options}, {}  # fmt: skip

    def inject(self, fault: str) -> None:
        assert fault == "restart"
        self.down = random.choice(self.servers)
        self.down.kill()

    def heal(self, fault: str) -> None:
        if self.down is not None:
            self.down.start()
            self.down = None

    def stop(self) -> None:
        for server in self.servers:
            server.cleanup()


class RedlockTarget(RedisTarget):
    name = "redlock"
    masters = 3


class EtcdTarget(Target):
    name = "etcd"
    faults = ("pause", "kill", "leader", *NETWORK, *PROXIED)

    def start(self, run: Run) -> None:
        ports = [(free_port(), free_port()) for _ in range(3)]
        self.members = start_etcd_cluster(ports, prefix=f"chaos{os.getpid()}-")
        self.down: Any = None

    def worker_settings(self, run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
        endpoints = []
        for member in self.members:
            host, port = run.lock_address(member.client_port)
            endpoints.append(f"{host}:{port}")
        return {"BACKEND": "django_dlock.backends.etcd.EtcdBackend", "LOCATION": endpoints,
                "OPTIONS": {"timeout": 2.0}}, {}  # fmt: skip

    def inject(self, fault: str) -> None:
        assert fault == "leader"
        leaders = [m for m in self.members if m.process is not None and m.is_leader()]
        self.down = leaders[0] if leaders else random.choice(self.members)
        self.down.kill()

    def heal(self, fault: str) -> None:
        if self.down is not None:
            self.down.start(wait=True)
            self.down = None

    def stop(self) -> None:
        for member in self.members:
            member.cleanup()


class ZooKeeperTarget(EtcdTarget):
    """A 3-server ensemble (100 ms ticks); the workers' sessions time out after TTL (2 s).

    Its ``leader`` fault, heal and stop are etcd's: the servers are its members.
    """

    name = "zookeeper"

    def start(self, run: Run) -> None:
        self.members = start_zookeeper([(free_port(), free_port(), free_port()) for _ in range(3)])
        self.down = None

    def worker_settings(self, run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
        hosts = []
        for server in self.members:
            host, port = run.lock_address(server.client_port)
            hosts.append(f"{host}:{port}")
        return {"BACKEND": "django_dlock.backends.zookeeper.ZooKeeperBackend", "LOCATION": hosts,
                "OPTIONS": {"session_timeout": TTL, "timeout": 2.0}}, {}  # fmt: skip


class ZooKeeperStandaloneTarget(ZooKeeperTarget):
    """One server; ``restart`` stops and starts it (its data on disk: sessions survive)."""

    name = "zookeeper1"
    faults = ("pause", "kill", "restart", *NETWORK, *PROXIED)

    def start(self, run: Run) -> None:
        self.members = start_zookeeper([(free_port(), free_port(), free_port())])
        self.down = None

    def inject(self, fault: str) -> None:
        assert fault == "restart"
        self.down = self.members[0]
        self.down.kill()


class PostgresTarget(Target):
    name = "postgresql"
    faults = ("pause", "kill", "terminate", *NETWORK, *PROXIED)

    def start(self, run: Run) -> None:
        _pg_admin(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)", f"CREATE DATABASE {DB}")
        _migrate({"default": self._database(PG["host"], PG["port"])})

    def _database(self, host: str, port: int) -> dict[str, Any]:
        return {"ENGINE": "django.db.backends.postgresql", "NAME": DB, "HOST": host,
                "PORT": port, "USER": PG["user"], "OPTIONS": {"connect_timeout": 2}}  # fmt: skip

    def worker_settings(self, run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
        host, port = run.lock_address(PG["port"])
        backend = {"BACKEND": "django_dlock.backends.database.DatabaseBackend"}
        return backend, {"default": self._database(host, port)}

    def inject(self, fault: str) -> None:
        assert fault == "terminate"
        _pg_admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{DB}' AND pid <> pg_backend_pid()"
        )

    def heal(self, fault: str) -> None:
        pass

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            _pg_admin(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


class MariaDBTarget(Target):
    name = "mariadb"
    faults = ("pause", "kill", "terminate", *NETWORK, *PROXIED)

    def start(self, run: Run) -> None:
        _mysql_admin(f"DROP DATABASE IF EXISTS {DB}", f"CREATE DATABASE {DB}")
        _migrate({"default": self._database(MYSQL["host"], MYSQL["port"])})

    def _database(self, host: str, port: int) -> dict[str, Any]:
        return {"ENGINE": "django.db.backends.mysql", "NAME": DB, "HOST": host, "PORT": port,
                "USER": MYSQL["user"], "PASSWORD": MYSQL["password"],
                "OPTIONS": {"connect_timeout": 2}}  # fmt: skip

    def worker_settings(self, run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
        host, port = run.lock_address(MYSQL["port"])
        backend = {"BACKEND": "django_dlock.backends.database.DatabaseBackend"}
        return backend, {"default": self._database(host, port)}

    def inject(self, fault: str) -> None:
        assert fault == "terminate"
        import MySQLdb

        conn = MySQLdb.connect(host=MYSQL["host"], port=MYSQL["port"], user=MYSQL["user"],
                               password=MYSQL["password"])  # fmt: skip
        try:
            cur = conn.cursor()
            cur.execute(
                "SELECT id FROM information_schema.processlist WHERE db = %s AND id <> "
                "CONNECTION_ID()",
                (DB,),
            )
            for (pid,) in cur.fetchall():
                with contextlib.suppress(MySQLdb.Error):
                    cur.execute(f"KILL CONNECTION {int(pid)}")
        finally:
            conn.close()

    def heal(self, fault: str) -> None:
        pass

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            _mysql_admin(f"DROP DATABASE IF EXISTS {DB}")


class SQLiteTarget(Target):
    name = "sqlite"
    faults = ("pause", "kill", "filelock", "clockstep")

    def start(self, run: Run) -> None:
        self.path = run.tmp / "locks.sqlite3"
        # SQLite keeps no clock: leases end by the wall clock of the processes
        # that use it, which the workers offset by this file's seconds
        # (chaos/worker.py; libfaketime would, but it breaks Python's sleep).
        self.clock = run.tmp / "sqlite-clock-offset"
        self.clock.write_text("0\n")
        self._stop_hold = threading.Event()
        self._holder: threading.Thread | None = None
        _migrate(self._databases())

    def _databases(self) -> dict[str, Any]:
        return {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(self.path)}}

    def worker_settings(self, run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"BACKEND": "django_dlock.backends.database.DatabaseBackend"}, self._databases()

    def worker_config(self) -> dict[str, Any]:
        return {"clock_offset_file": str(self.clock)}

    def inject(self, fault: str) -> None:
        if fault == "clockstep":
            _write_atomic(self.clock, "30\n")
            return
        assert fault == "filelock"
        locked = threading.Event()
        self._stop_hold.clear()

        def hold() -> None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            try:
                conn.execute("BEGIN EXCLUSIVE")
                locked.set()
                self._stop_hold.wait(60)
                conn.execute("COMMIT")
            finally:
                conn.close()

        self._holder = threading.Thread(target=hold, daemon=True)
        self._holder.start()
        locked.wait(30)

    def heal(self, fault: str) -> None:
        if fault == "clockstep":
            _write_atomic(self.clock, "0\n")
            return
        self._stop_hold.set()
        if self._holder is not None:
            self._holder.join(30)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


#: What ``--kind`` makes the workers hold.
KINDS = ("mutex", "semaphore", "rwlock")
#: Targets whose backend has no semaphores.
NO_SEMAPHORES = ("redlock", "zookeeper", "zookeeper1")

TARGETS: dict[str, type[Target]] = {
    t.name: t
    for t in (
        RedisTarget,
        RedlockTarget,
        EtcdTarget,
        ZooKeeperTarget,
        ZooKeeperStandaloneTarget,
        PostgresTarget,
        MariaDBTarget,
        SQLiteTarget,
    )
}


def _pg_admin(*statements: str, dbname: str = "postgres") -> None:
    import psycopg

    with psycopg.connect(
        host=PG["host"], port=PG["port"], user=PG["user"], dbname=dbname, autocommit=True
    ) as conn:
        for statement in statements:
            conn.execute(statement)


def _mysql_admin(*statements: str) -> None:
    import MySQLdb

    conn = MySQLdb.connect(host=MYSQL["host"], port=MYSQL["port"], user=MYSQL["user"],
                           password=MYSQL["password"])  # fmt: skip
    try:
        for statement in statements:
            conn.cursor().execute(statement)
    finally:
        conn.close()


def _migrate(databases: dict[str, Any]) -> None:
    config = {"databases": databases, "backend": {}, "migrate": True}
    subprocess.run(
        [sys.executable, "-m", "chaos.worker"],
        env={**os.environ, "DLOCK_CHAOS_CONFIG": json.dumps(config)},
        cwd=ROOT,
        check=True,
        timeout=120,
    )


class Workers:
    """The worker processes of one target; each can be paused, killed and respawned."""

    def __init__(self, run: Run, target: Target, config: dict[str, Any]) -> None:
        self.run = run
        self.config = config
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs = run.tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        for i in range(WORKERS):
            self.spawn(i)

    def spawn(self, i: int) -> None:
        config = {**self.config, "worker": i}
        prefix = self.run.net.prefix() if self.run.net is not None else []
        with open(self.logs / f"{self.config['table']}-{i}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(
                [*prefix, sys.executable, "-m", "chaos.worker"],
                env={**os.environ, "DLOCK_CHAOS_CONFIG": json.dumps(config)},
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )

    def holder(self) -> int | None:
        """The worker that took the lock last (its pid is in the holding file)."""
        try:
            pid = int(Path(self.config["holding"]).read_text())
        except (OSError, ValueError):
            return None
        for i, proc in self.procs.items():
            if proc.pid == pid and proc.poll() is None:
                return i
        return None

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _load(path: Path) -> list[dict[str, Any]]:
    events = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def run_target(
    run: Run, target: Target, faults: list[str], phase_seconds: float, kind: str = "mutex"
) -> list[history.PhaseResult]:
    table = f"chaos_{target.name}"
    _pg_admin(
        f"CREATE TABLE IF NOT EXISTS {table}_reg (name text PRIMARY KEY, fence bigint NOT NULL, "
        "counter bigint NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {table}_log (id bigserial PRIMARY KEY, name text, "
        "token bigint, value bigint)",
        f"TRUNCATE {table}_reg, {table}_log",
        f"INSERT INTO {table}_reg VALUES ('chaos', -1, 0)",
        dbname=REGISTER_DB,
    )
    target.start(run)
    hist = run.tmp / f"{table}.jsonl"
    phases: list[history.Phase] = []
    workers: Workers | None = None
    try:
        backend, databases = target.worker_settings(run)
        config = {
            "backend": backend,
            "databases": databases,
            "register": run.register_dsn(),
            "table": table,
            "name": "chaos",
            "kind": kind,
            "ttl": TTL,
            "timeout": TIMEOUT,
            "hold": 0.2,
            "long_share": 0.05,
            "pause": 0.02,
            "history": str(hist),
            "holding": str(run.tmp / f"{table}.holding"),
            **target.worker_config(),
        }
        workers = Workers(run, target, config)
        _wait_started(hist, 60)
        time.sleep(1.0)
        for fault in faults:
            phases.append(_phase(run, target, workers, FAULTS[fault], phase_seconds))
    finally:
        if run.net is not None:
            run.net.heal()
        run.latency(0.0)
        run.replies()
        if workers is not None:
            workers.stop()
        run.close_proxies()
        target.stop()
    events = _load(hist)
    rows = _register_rows(table)
    return _check(target, phases, events, rows)


def _wait_started(hist: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = {e["w"] for e in _load(hist) if e["op"] == "start"}
        if len(started) >= WORKERS:
            return
        time.sleep(0.2)
    raise RuntimeError(f"workers did not start within {timeout:g}s (logs in {hist.parent})")


def _phase(
    run: Run, target: Target, workers: Workers, fault: Fault, seconds: float
) -> history.Phase:
    phase = history.Phase(
        fault.name, time.monotonic(), 0.0, pauses=fault.pauses, exclusive=not fault.loses_data
    )
    deadline = phase.start + seconds
    while True:
        injected = time.monotonic()
        undo = _inject(run, target, workers, fault)
        time.sleep(fault.lasts)
        undo()
        healed = time.monotonic()
        phase.episodes.append((injected, healed))
        time.sleep(TTL + RECOVERY)
        if time.monotonic() >= deadline:
            break
    phase.end = time.monotonic()
    return phase


def _inject(run: Run, target: Target, workers: Workers, fault: Fault) -> Any:
    """Start ``fault``; return what ends it."""
    name = fault.name
    if name in ("pause", "kill"):
        i = workers.holder()
        if i is None:
            i = random.randrange(WORKERS)
        proc = workers.procs[i]
        if name == "pause":
            proc.send_signal(signal.SIGSTOP)
            return lambda: proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)
        return lambda: workers.spawn(i)
    if name in PROXIED:
        if name == "late":
            run.replies(bunch=0.8)
        else:
            run.replies(jitter=0.3)
        return run.replies
    if name in NETWORK:
        net = run.net
        assert net is not None
        if name == "latency":
            run.latency(0.1)
            return lambda: run.latency(0.0)
        switch = {"partition": net.partition, "blackhole": net.blackhole, "loss": net.loss}[name]
        switch(True)
        return lambda: switch(False)
    target.inject(name)
    return lambda: target.heal(name)


def _register_rows(table: str) -> list[tuple[int, int]]:
    import psycopg

    with psycopg.connect(host=PG["host"], port=PG["port"], user=PG["user"],
                         dbname=REGISTER_DB) as conn:  # fmt: skip
        rows = conn.execute(f"SELECT token, value FROM {table}_log ORDER BY id").fetchall()
    return [(int(t), int(v)) for t, v in rows]


def _check(
    target: Target,
    phases: list[history.Phase],
    events: list[dict[str, Any]],
    rows: list[tuple[int, int]],
) -> list[history.PhaseResult]:
    holds = history.holds(events)
    results = [history.check_phase(p, events, holds, liveness_bound=TTL + SLACK) for p in phases]

    def phase_at(t: float) -> int:
        for i, p in enumerate(phases):
            if t < p.end:
                return i
        return len(phases) - 1

    written = {e["token"]: e["cmp"] for e in events if e["op"] == "write" and "cmp" in e}
    for token, problem in history.check_register(rows):
        results[phase_at(written.get(token, 0.0))].violations.append(problem)
    for at, problem in history.check_tokens(events):
        results[phase_at(at)].violations.append(problem)
    errors = [e for e in events if e.get("why") == "error"]
    for e in errors[:3]:
        results[phase_at(e["cmp"])].violations.append(f"unexpected error: {e.get('error')}")
    return results


def plan(
    targets: list[str], faults: list[str] | None, short: bool, net_ok: bool
) -> list[tuple[str, list[str]]]:
    """(target, its faults) to run. ``short``: each fault once and each target at least once."""
    cells: dict[str, list[str]] = {t: [] for t in targets}
    wanted = [f for f in FAULTS if faults is None or f in faults]
    if not net_ok:
        wanted = [f for f in wanted if f not in NETWORK]
    for fault in wanted:
        able = [t for t in targets if fault in TARGETS[t].faults]
        if short:
            if able:
                cells[min(able, key=lambda t: (len(cells[t]), targets.index(t)))].append(fault)
        else:
            for t in able:
                cells[t].append(fault)
    if short:
        for t in targets:
            if not cells[t]:
                first = next((f for f in TARGETS[t].faults if f in wanted), None)
                if first:
                    cells[t].append(first)
    return [(t, [f for f in FAULTS if f in cells[t]]) for t in targets if cells[t]]


def table(rows: list[tuple[str, history.PhaseResult]]) -> str:
    head = ("backend", "fault", "operations", "acquisitions", "fenced writes refused",
            "overlaps", "violations", "longest unavailable")  # fmt: skip
    lines = [head]
    for backend, r in rows:
        lines.append((backend, r.fault, str(r.operations), str(r.acquisitions),
                      str(r.writes_refused), str(r.overlaps), str(len(r.violations)),
                      f"{r.longest_unavailable:.2f} s"))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for n, line in enumerate(lines):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--seconds", type=float, default=600.0, help="time for the fault phases (default 600)"
    )
    parser.add_argument(
        "--short", action="store_true", help="each fault once, each backend at least once"
    )
    parser.add_argument("--backends", default=",".join(TARGETS))
    parser.add_argument("--faults", default=None, help="comma-separated (default: all)")
    parser.add_argument("--kind", choices=KINDS, default="mutex", help="what the workers hold")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the histories and worker logs in this dir"
    )
    args = parser.parse_args(argv)
    targets = [t for t in args.backends.split(",") if t]
    if args.kind != "mutex":
        targets = [t for t in targets if t not in NO_SEMAPHORES]
    unknown = [t for t in targets if t not in TARGETS]
    faults = None if args.faults is None else [f for f in args.faults.split(",") if f]
    if unknown or (faults and any(f not in FAULTS for f in faults)):
        parser.error(f"backends are {', '.join(TARGETS)}; faults are {', '.join(FAULTS)}")
    # A hangup or a kill(1) still runs the clean-up below: the namespace, the
    # servers and the workers go with the run.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    why_not = nemesis.available()
    if why_not:
        print(f"chaos: skipping the network faults: {why_not}", file=sys.stderr)
    cells = plan(targets, faults, args.short, why_not is None)
    phases = sum(len(fs) for _, fs in cells)
    phase_seconds = 0.0 if args.short else args.seconds / max(1, phases)
    started = time.monotonic()
    rows: list[tuple[str, history.PhaseResult]] = []
    with contextlib.ExitStack() as stack:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dlock-chaos-"))
        _pg_admin(f"DROP DATABASE IF EXISTS {REGISTER_DB} WITH (FORCE)",
                  f"CREATE DATABASE {REGISTER_DB}")  # fmt: skip
        net = nemesis.Net() if why_not is None else None
        try:
            run = Run(net, Path(tmp))
            for name, fs in cells:
                print(f"chaos: {name}: {', '.join(fs)}", file=sys.stderr, flush=True)
                for result in run_target(run, TARGETS[name](), fs, phase_seconds, args.kind):
                    rows.append((name, result))
        finally:
            if net is not None:
                net.close()
            with contextlib.suppress(Exception):
                _pg_admin(f"DROP DATABASE IF EXISTS {REGISTER_DB} WITH (FORCE)")
    elapsed = time.monotonic() - started
    print(table(rows))
    command = " ".join(["python -m chaos", *(argv if argv is not None else sys.argv[1:])])
    print(f"The workers held: {args.kind}")
    print(f"\n{command}: {elapsed:.0f} s, TTL {TTL:g} s, {WORKERS} workers per backend, "
          f"liveness bound TTL + {SLACK:g} s after each heal")  # fmt: skip
    bad = [(b, r) for b, r in rows if r.violations]
    for backend, r in bad:
        for v in r.violations:
            print(f"VIOLATION {backend}/{r.fault}: {v}")
    if args.json is not None:
        args.json.write_text(json.dumps(
            {"command": command, "seconds": elapsed, "ttl": TTL, "slack": SLACK,
             "rows": [{"backend": b, **asdict(r)} for b, r in rows]}, indent=2))  # fmt: skip
    return 1 if bad else 0
