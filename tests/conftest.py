from __future__ import annotations

import os
import re
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.servers import (
    EtcdServer,
    RedisServer,
    make_test_ca,
    start_cluster,
    start_etcd_cluster,
    start_zookeeper,
)

#: The backend_alias parametrization over settings.CONFORMANCE_BACKENDS, the
#: backends/with_default_db markers and the backend, name, short_ttl and
#: past_expiry fixtures: the conformance suite's own plugin, which runs it here too.
pytest_plugins = ["django_dlock.testing.plugin"]


#: Test modules whose tests share a costly module-scoped fixture (a Celery
#: worker, a browser, a load run): under pytest-xdist (`make test`) each
#: module's tests run on one worker, which sets it up once. Every other test
#: runs on whichever worker is free.
#: test_multiprocess.py's tests run 8 processes each, busy on 2 cores: one at
#: a time, as without xdist, they leave the other workers' timings alone.
XDIST_GROUPS = {
    "test_admin_browser.py": "admin-browser",
    "test_celery_worker.py": "celery-worker",
    "test_multiprocess.py": "eight-processes",
    "test_realproject.py": "realproject",
}

#: The tests on the session's etcd members run in this many groups: each
#: worker that starts them keeps a single member and a 3-member cluster with
#: 10 ms heartbeats busy. One group: with two, etcd took 260 of the 1,330
#: CPU-seconds of a 4-worker run (2026-11-28), on a machine of 2 cores.
ETCD_GROUPS = 1

_ETCD_PARAM = re.compile(r"\[etcd[-\]]")


def forks(nodeid: str) -> bool:
    """Whether the test ``nodeid`` forks its process (each such test says so in its name).

    A child forked while gRPC's threads (an etcd client's) are busy may die
    in gRPC's code: these tests run in the etcd group, before any etcd test
    of their worker, so that their process has no gRPC thread yet.
    """
    rest = nodeid.partition("::")[2]
    # The database aliases' keep pytest-django's order (transactional tests last).
    return "fork" in rest and "[db-" not in rest


def xdist_group(nodeid: str) -> str | None:
    """The group of the test ``nodeid`` runs in, or None: on any worker."""
    path, _, rest = nodeid.partition("::")
    group = XDIST_GROUPS.get(path.rsplit("/", 1)[-1])
    if group is not None:
        return group
    if forks(nodeid) or path.endswith("/test_etcd.py") or _ETCD_PARAM.search(rest):
        # crc32, not hash(): the same group in every process.
        return f"etcd-{zlib.crc32(nodeid.encode()) % ETCD_GROUPS}"
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist load``, but the tests of a group go to one worker, as one unit of work.

    Not pytest-xdist's own ``--dist loadgroup``: it marks groups by changing
    each test's node id, which pytest 9 ignores (it then groups nothing).
    """
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid) or nodeid

    return GroupScheduling(config, log)


@pytest.hookimpl(trylast=True)  # after pytest-django's own order
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest work first, so that no worker starts it when the others are done.

    A group runs as one unit, and tests that start processes (marked
    ``multiprocess``) take seconds each. Only those that use no test database:
    the others keep pytest-django's order (transactional tests last).
    """

    def rank(item: pytest.Item) -> tuple[int, int]:
        # The tests that fork before every other (the etcd ones last among
        # them): their group's worker has started no gRPC thread yet.
        first = 0 if forks(item.nodeid) and not _is_etcd(item) else 1
        if item.get_closest_marker("django_db") is not None:
            return 2, 1
        if xdist_group(item.nodeid) is not None:
            return 0, first
        return (1 if item.get_closest_marker("multiprocess") is not None else 2), first

    items.sort(key=rank)


def _is_etcd(item: pytest.Item) -> bool:
    path, _, rest = item.nodeid.partition("::")
    return path.endswith("/test_etcd.py") or _ETCD_PARAM.search(rest) is not None


@pytest.fixture(scope="session")
def redis_servers() -> Iterator[dict[str, Any]]:
    """The single node, the 3-master cluster, and Redlock's 3 masters (the third stopped)."""
    ports = settings.REDIS_PORTS
    single = RedisServer(ports["single"]).start()
    cluster = start_cluster(ports["cluster"])
    redlock = [RedisServer(port).start() for port in ports["redlock"]]
    redlock[2].stop()
    servers = {"single": single, "cluster": cluster, "redlock": redlock}
    yield servers
    for server in [single, *cluster, *redlock]:
        server.cleanup()


@pytest.fixture(scope="session")
def etcd_servers() -> Iterator[dict[str, Any]]:
    """A single etcd member and a 3-member cluster, each its own processes."""
    ports = settings.ETCD_PORTS
    client, peer = ports["single"]
    single = EtcdServer("single", client, peer, {"single": peer}).start()
    cluster = start_etcd_cluster(ports["cluster"], prefix="m")
    yield {"single": single, "cluster": cluster}
    for server in [single, *cluster]:
        server.cleanup()


@pytest.fixture(scope="session")
def zookeeper_servers() -> Iterator[dict[str, Any]]:
    """A standalone ZooKeeper server and a 3-server ensemble, each its own processes."""
    ports = settings.ZK_PORTS
    single = start_zookeeper(ports["single"])
    ensemble = start_zookeeper(ports["ensemble"])
    yield {"single": single[0], "ensemble": ensemble}
    from django_dlock import locks

    for backend in ("zookeeper", "zookeeper-ensemble"):
        locks[backend].close()
    for server in [*single, *ensemble]:
        server.cleanup()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A test CA with server and client certificates for 127.0.0.1."""
    return make_test_ca(tmp_path_factory.mktemp("tls"))


@pytest.fixture(autouse=True)
def _servers_for_backend(request: pytest.FixtureRequest) -> None:
    if "backend_alias" in request.fixturenames:
        alias = request.getfixturevalue("backend_alias")
        if alias.startswith(("redis", "redlock")):
            request.getfixturevalue("redis_servers")
        elif alias.startswith("etcd"):
            request.getfixturevalue("etcd_servers")
        elif alias.startswith("zookeeper"):
            request.getfixturevalue("zookeeper_servers")
    elif request.node.path.name == "test_etcd.py":
        # Some of its tests use the "etcd" alias without asking for the servers:
        # under xdist no earlier test of the same process need have started them.
        request.getfixturevalue("etcd_servers")


#: What each backend's ping names: the server it reached, and its version.
PING_VERSIONS = {
    "locmem": r"^locmem ",
    "example": r"^SQLite 3\.\d+",
    "db-sqlite": r"^SQLite 3\.\d+",
    "db-postgresql": r"^PostgreSQL \d+\.\d+",
    "db-mysql": r"^(MariaDB|MySQL) \d+\.\d+\.\d+",
    "redis": r"^Redis \d+\.\d+\.\d+$",
    "redis-fair": r"^Redis \d+\.\d+\.\d+$",
    "redis-cluster": r"^Redis \d+\.\d+\.\d+$",
    "redlock": r"^Redis \d+\.\d+\.\d+$",
    "etcd": r"^etcd 3\.\d+\.\d+$",
    "etcd-cluster": r"^etcd 3\.\d+\.\d+$",
    "zookeeper": r"^ZooKeeper 3\.\d+\.\d+$",
    "zookeeper-ensemble": r"^ZooKeeper 3\.\d+\.\d+$",
}


@pytest.fixture
def ping_expected(backend_alias: str) -> tuple[str, tuple[str, ...]]:
    """The plugin's fixture for our servers: each one's version; Redlock's stopped master."""
    if backend_alias == "redlock":
        # The test session stops the third master: locking works, ping says so.
        return PING_VERSIONS[backend_alias], (f":{settings.REDIS_PORTS['redlock'][2]}/",)
    return PING_VERSIONS[backend_alias], ()


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [
        t
        for t in threading.enumerate()
        if t.ident not in before and t.is_alive() and not _long_lived(t)
    ]
    for t in leaked:
        t.join(timeout=5)
    assert not [t for t in leaked if t.is_alive()], f"threads left running: {leaked}"


def _long_lived(thread: threading.Thread) -> bool:
    """Threads that live as long as the process by design.

    The watchdog and the etcd backend's watch stream, gRPC's own threads
    that serve that stream (they end with it), a ZooKeeper client's (its session's
    connection and callbacks), and asgiref's executor thread.
    """
    from asgiref.sync import SyncToAsync

    if thread in getattr(SyncToAsync.single_thread_executor, "_threads", ()):
        return True  # asgiref's one thread for sync code called from async (AsyncClient)
    target = getattr(thread, "_target", None)
    return thread.name.startswith("django-dlock-") or (
        getattr(target, "__module__", "") or ""
    ).startswith(("grpc.", "kazoo."))


@pytest.fixture(scope="session")
def django_db_modify_db_settings_xdist_suffix() -> None:
    """No "_gw0" suffix: each xdist worker's test databases have names of their own already.

    settings.py names the server databases after the worker's process and puts
    the SQLite file in the worker's temp dir, where the processes a test starts
    with these settings (db_worker) find it under the same name.
    """


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """Let Django drop the PostgreSQL test database.

    The watchdog thread and test threads keep their own connections open;
    PostgreSQL refuses DROP DATABASE while any session uses it.
    """
    yield
    from django.db import connections

    with django_db_blocker.unblock():
        for connection in connections.all():
            if connection.vendor != "postgresql":
                continue
            if connection.settings_dict["NAME"] != connection.creation._get_test_db_name():
                continue  # no test selected this database, so it was never created
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )


# tests/newcomer/ needs other settings; tests/test_newcomer.py runs it in its own session.
if os.environ.get("DJANGO_SETTINGS_MODULE") != "tests.newcomer.settings":
    collect_ignore = ["newcomer"]
