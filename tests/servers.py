"""Real redis-server, etcd and Celery worker processes for the tests, in temp dirs.

The tests own these processes, so fault tests can stop, kill and restart them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: Ports this process has handed out: a port is not bound until its server
#: starts, so a second pick must not take it meanwhile.
_handed_out: set[int] = set()


def _port_range() -> range:
    """Where this process picks its ports: under pytest-xdist, a slice of its own.

    Servers listen on ports from 10000 up to 10000 below the kernel's ephemeral
    range, and a Redis cluster node's bus port (port + 10000) lies above those:
    so no worker's bus port is another worker's server port either.
    """
    low = 10000
    high = min(_ephemeral_start(), 55536)
    span = min(high - low, 10000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return range(low, low + span)
    index = int(worker[2:])
    width = span // count
    return range(low + index * width, low + (index + 1) * width)


def free_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too.

    Below the kernel's ephemeral range: a client connecting to a stopped
    server's port in that range can, now and then, be given that very port as
    its own source port and connect to itself (TCP simultaneous open), reading
    back its own command as the reply.
    """
    rng = random.Random()
    ports = _port_range()
    for _ in range(1000):
        port = rng.choice(ports)
        if port not in _handed_out and _bindable(port) and _bindable(port + 10000):
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port pair for redis-server")


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def redis_cli(port: int, *args: str) -> str:
    return subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=30
    ).stdout


class _ServerProcess:
    """A server process the tests own, with its temp dir."""

    dir: Path
    process: subprocess.Popen[bytes] | None

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=20)
            self.process = None

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer(_ServerProcess):
    """One redis-server that keeps nothing on disk unless told to."""

    def __init__(self, port: int, *extra: str) -> None:
        self.port = port
        self.extra = extra
        self.dir = Path(tempfile.mkdtemp(prefix=f"dlock-redis-{port}-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.dir),
                "--logfile", str(self.dir / "redis.log"),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            # A server with --requirepass answers NOAUTH: it is up all the same.
            wait_for(
                lambda: redis_cli(self.port, "ping").startswith(("PONG", "NOAUTH")),
                20,
                f"redis-server on port {self.port} (log: {self.dir / 'redis.log'})",
            )
        except RuntimeError:
            self.kill()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=20)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


def start_cluster(ports: list[int]) -> list[RedisServer]:
    """Three masters, no replicas, every slot assigned."""
    servers = [
        RedisServer(
            port,
            "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", "2000",
        ).start()
        for port in ports
    ]  # fmt: skip
    subprocess.run(
        [
            "redis-cli", "--cluster", "create",
            *(f"127.0.0.1:{p}" for p in ports),
            "--cluster-replicas", "0", "--cluster-yes",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    for port in ports:
        wait_for(
            lambda port=port: "cluster_state:ok" in redis_cli(port, "cluster", "info"),
            30,
            f"cluster state ok on {port}",
        )
    return servers


_ETCDCTL_ENV = {**os.environ, "ETCDCTL_API": "3"}


def etcdctl(endpoint: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["etcdctl", f"--endpoints={endpoint}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_ETCDCTL_ENV,
    )


def etcdctl_popen(endpoint: str, *args: str) -> subprocess.Popen[str]:
    """``etcdctl`` left running (``etcdctl lock`` holds until it is signalled)."""
    return subprocess.Popen(
        ["etcdctl", f"--endpoints={endpoint}", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=_ETCDCTL_ENV,
    )


class EtcdServer(_ServerProcess):
    """One etcd member (from Debian's etcd-server) with fast elections.

    ``--heartbeat-interval 10 --election-timeout 100`` lets a 3-node cluster
    elect a new leader within a few hundred milliseconds of losing one, and
    makes the shortest lease etcd grants one second.
    """

    def __init__(
        self,
        name: str,
        client_port: int,
        peer_port: int,
        cluster: dict[str, int],
        *extra: str,
        scheme: str = "http",
    ) -> None:
        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        self.cluster = cluster
        self.extra = extra
        self.scheme = scheme
        self.dir = Path(tempfile.mkdtemp(prefix=f"dlock-etcd-{name}-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.started_once = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, wait: bool = True) -> EtcdServer:
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in self.cluster.items())
        client_url = f"{self.scheme}://127.0.0.1:{self.client_port}"
        self.process = subprocess.Popen(
            [
                "etcd",
                "--name", self.name,
                "--data-dir", str(self.dir / "data"),
                "--listen-client-urls", client_url,
                "--advertise-client-urls", client_url,
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster", initial,
                "--initial-cluster-state", "existing" if self.started_once else "new",
                "--initial-cluster-token", f"dlock-{os.getpid()}-{min(self.cluster.values())}",
                "--heartbeat-interval", "10",
                "--election-timeout", "100",
                "--logger", "zap",
                "--log-outputs", str(self.dir / "etcd.log"),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.started_once = True
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        if self.scheme != "http":
            wait_for(lambda: port_open("127.0.0.1", self.client_port), 30, f"etcd {self.name}")
            return

        def healthy() -> bool:
            # On a loaded machine a health check can outlast its own timeout:
            # that is "not yet", not a failure to start.
            try:
                return etcdctl(self.endpoint, "endpoint", "health", timeout=5).returncode == 0
            except subprocess.TimeoutExpired:
                return False

        try:
            wait_for(
                healthy,
                30,
                f"etcd {self.name} on port {self.client_port} (log: {self.dir / 'etcd.log'})",
            )
        except RuntimeError:
            self.kill()
            raise

    def is_leader(self) -> bool:
        out = etcdctl(self.endpoint, "endpoint", "status", "-w", "json", timeout=5).stdout
        try:
            [status] = json.loads(out)
        except ValueError:
            return False
        header = status["Status"]["header"]
        return bool(header["member_id"] == status["Status"]["leader"])


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def start_etcd_cluster(ports: list[tuple[int, int]], prefix: str) -> list[EtcdServer]:
    """Members ``{prefix}0..n`` on (client port, peer port) pairs, started together."""
    cluster = {f"{prefix}{i}": peer for i, (_, peer) in enumerate(ports)}
    members = [
        EtcdServer(f"{prefix}{i}", client, peer, cluster) for i, (client, peer) in enumerate(ports)
    ]
    try:
        for member in members:
            member.start(wait=False)
        for member in members:
            member.wait_healthy()
    except BaseException:
        # Members that did start must not outlive a cluster that failed to.
        for member in members:
            member.cleanup()
        raise
    return members


#: Where Debian's zookeeperd (the "zookeeper" package) puts the server.
ZK_SCRIPT = "/usr/share/zookeeper/bin/zkServer.sh"


def zookeeper_installed() -> bool:
    return os.path.exists(ZK_SCRIPT) and shutil.which("java") is not None


def zk_command(port: int, word: str, timeout: float = 2.0) -> str:
    """A four-letter word's reply (``ruok``, ``srvr``), or "" if none came."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(word.encode())
            chunks = []
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


class ZooKeeperServer(_ServerProcess):
    """One ZooKeeper server (Debian's zookeeperd) with 100 ms ticks.

    Sessions may then be 0.2 s to 2 s long (2 to 20 ticks), so a dead
    holder's locks go within the conformance suite's lease lengths. ``ensemble``
    maps server id -> (client port, quorum port, election port).
    """

    def __init__(
        self, sid: int, ensemble: dict[int, tuple[int, int, int]], extra: tuple[str, ...] = ()
    ) -> None:
        self.sid = sid
        self.ensemble = ensemble
        self.client_port = ensemble[sid][0]
        self.dir = Path(tempfile.mkdtemp(prefix=f"dlock-zk-{sid}-"))
        self.process: subprocess.Popen[bytes] | None = None
        (self.dir / "data").mkdir()
        (self.dir / "data" / "myid").write_text(f"{sid}\n")
        lines = [
            "tickTime=100",
            "initLimit=50",
            "syncLimit=20",
            f"dataDir={self.dir / 'data'}",
            f"clientPort={self.client_port}",
            "clientPortAddress=127.0.0.1",
            "admin.enableServer=false",
            "4lw.commands.whitelist=srvr,ruok,mntr,stat",
            "maxClientCnxns=0",
            *extra,
        ]
        if len(ensemble) > 1:
            for i, (_, quorum, election) in sorted(ensemble.items()):
                lines.append(f"server.{i}=127.0.0.1:{quorum}:{election}")
        (self.dir / "zoo.cfg").write_text("\n".join(lines) + "\n")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, wait: bool = True) -> ZooKeeperServer:
        env = {
            **os.environ,
            "ZOO_LOG_DIR": str(self.dir),
            "ZOO_LOG4J_PROP": "WARN,ROLLINGFILE",
            "JVMFLAGS": "-Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1",
        }
        with open(self.dir / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                [ZK_SCRIPT, "start-foreground", str(self.dir / "zoo.cfg")],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        if wait:
            self.wait_serving()
        return self

    def serving(self) -> bool:
        return "Mode: " in zk_command(self.client_port, "srvr")

    def mode(self) -> str:
        for line in zk_command(self.client_port, "srvr").splitlines():
            if line.startswith("Mode: "):
                return line[len("Mode: ") :].strip()
        return ""

    def is_leader(self) -> bool:
        return self.mode() == "leader"

    def wait_serving(self, timeout: float = 60) -> None:
        try:
            what = f"ZooKeeper {self.sid} on {self.client_port} ({self.dir})"
            wait_for(self.serving, timeout, what)
        except RuntimeError:
            self.kill()
            raise

    def signal(self, sig: int) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=20)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


def start_zookeeper(
    ports: list[tuple[int, int, int]], extra: tuple[str, ...] = ()
) -> list[ZooKeeperServer]:
    """A standalone server (one port triple) or an ensemble (three), started together.

    ``extra``: more ``zoo.cfg`` lines (``maxSessionTimeout=20000``).
    """
    ensemble = {i + 1: triple for i, triple in enumerate(ports)}
    servers = [ZooKeeperServer(sid, ensemble, extra) for sid in ensemble]
    try:
        for server in servers:
            server.start(wait=False)
        for server in servers:
            server.wait_serving()
    except BaseException:
        for server in servers:
            server.cleanup()
        raise
    return servers


def make_test_ca(d: Path) -> dict[str, Path]:
    """A throwaway CA in ``d``, a server certificate for 127.0.0.1 and a client certificate.

    Well-formed enough for strict verification (Python 3.13's default
    VERIFY_X509_STRICT): a CA with key usage, leaves with key identifiers.
    """

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=dlock-test-ca", "-keyout", "ca.key", "-out", "ca.crt",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    for leaf, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={leaf}",
                "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr")  # fmt: skip
        (d / f"{leaf}.ext").write_text(
            "subjectAltName=IP:127.0.0.1\n"
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage={usage}\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid,issuer\n"
        )
        openssl("x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-extfile", f"{leaf}.ext",
                "-out", f"{leaf}.crt")  # fmt: skip
    return {
        "ca": d / "ca.crt",
        "cert": d / "server.crt",
        "key": d / "server.key",
        "client_cert": d / "client.crt",
        "client_key": d / "client.key",
    }


class CeleryWorker(_ServerProcess):
    """``celery -A testproject worker`` (prefork) on ``broker``, in its own process group.

    It imports tests.settings like the test process, so its "celery" lock
    alias is the same server's.
    """

    def __init__(
        self,
        name: str,
        broker: str,
        result_backend: str,
        queue: str,
        concurrency: int = 6,
        app: str = "testproject",
        loglevel: str = "INFO",
    ) -> None:
        root = Path(__file__).resolve().parent.parent
        self.name = name
        # Unique on a broker that other test sessions (xdist workers) share.
        self.nodename = f"{name}-{os.getpid()}@{socket.gethostname()}"
        self.queue = queue
        self.concurrency = concurrency
        self.app = app
        self.loglevel = loglevel
        self.dir = Path(tempfile.mkdtemp(prefix=f"dlock-celery-{name}-"))
        self.log = self.dir / "worker.log"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": os.pathsep.join([str(root), str(root / "testproject")]),
            "CELERY_BROKER_URL": broker,
            "CELERY_RESULT_BACKEND": result_backend,
            "DLOCK_TEST_CELERY_QUEUE": queue,
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, ready: Callable[[], bool] | None = None) -> CeleryWorker:
        """Start it and wait until ``ready()`` (default: the log at INFO says so)."""
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", self.app, "worker",
                "-P", "prefork", "-c", str(self.concurrency), "-n", self.nodename,
                "-Q", self.queue, "-l", self.loglevel, "--logfile", str(self.log),
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            wait_for(
                ready or (lambda: self.log.exists() and " ready." in self.log.read_text()),
                60,
                f"celery worker {self.nodename} (log: {self.log})",
            )
        except RuntimeError:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL the whole worker: the main process and its pool children."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=20)
            self.process = None
