"""Settings for the test suite: the test project plus every database we support.

PostgreSQL and MariaDB/MySQL are the machine's servers on loopback (override
with DLOCK_TEST_PG_* / DLOCK_TEST_MYSQL_*). A server that does not answer is
left out and its tests are skipped with the reason, unless
DLOCK_REQUIRE_ALL_BACKENDS=1 (as in CI), which makes that an error.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

from testproject.settings import *  # noqa: F403
from testproject.settings import INSTALLED_APPS

from tests.servers import free_port, port_open, zookeeper_installed

INSTALLED_APPS = [*INSTALLED_APPS, "tests"]

REQUIRE_ALL = os.environ.get("DLOCK_REQUIRE_ALL_BACKENDS") == "1"

# Under pytest-xdist (`make test`), each worker is a test session of its own:
# its own temp dir, redis-server and etcd processes on its own ports, test
# databases (pytest-django adds the worker's id to their names) and Celery
# queues. The controller process imported these settings first, and the
# workers inherit its environment: a worker forgets the controller's choices
# once, and the processes it starts (Celery workers, db_worker) inherit its own.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _XDIST_WORKER and os.environ.get("DLOCK_TEST_SESSION") != _XDIST_WORKER:
    for _variable in (
        "DLOCK_TEST_TMP",
        "DLOCK_TEST_REDIS_PORTS",
        "DLOCK_TEST_ETCD_PORTS",
        "DLOCK_TEST_ZK_PORTS",
    ):
        os.environ.pop(_variable, None)
    os.environ["DLOCK_TEST_SESSION"] = _XDIST_WORKER
_TMP = os.environ.setdefault(
    "DLOCK_TEST_TMP", tempfile.mkdtemp(prefix=f"dlock-tests-{os.getpid()}-")
)


def _shared_ports(variable: str, pick: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    if variable not in os.environ:
        os.environ[variable] = json.dumps(pick())
    return json.loads(os.environ[variable])  # type: ignore[no-any-return]


PG = {
    "host": os.environ.get("DLOCK_TEST_PG_HOST", "127.0.0.1"),
    "port": int(os.environ.get("DLOCK_TEST_PG_PORT", "5432")),
    "user": os.environ.get("DLOCK_TEST_PG_USER", "postgres"),
    "password": os.environ.get("DLOCK_TEST_PG_PASSWORD", ""),
}
MYSQL = {
    "host": os.environ.get("DLOCK_TEST_MYSQL_HOST", "127.0.0.1"),
    "port": int(os.environ.get("DLOCK_TEST_MYSQL_PORT", "3306")),
    "user": os.environ.get("DLOCK_TEST_MYSQL_USER", "root"),
    "password": os.environ.get("DLOCK_TEST_MYSQL_PASSWORD", ""),
}

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(_TMP, "dlock.sqlite3"),
        # A file, not Django's in-memory test database: the multi-process
        # tests open it from other processes.
        "TEST": {"NAME": os.path.join(_TMP, "test_dlock.sqlite3")},
        "OPTIONS": {"timeout": 30},
    },
}

#: alias in DLOCK_BACKENDS -> why its tests are skipped
UNAVAILABLE_BACKENDS: dict[str, str] = {}


def _server_database(engine: str, server: dict[str, Any], **options: Any) -> dict[str, Any]:
    """A DATABASES entry for a shared server; each test run gets its own test database."""
    entry: dict[str, Any] = {
        "ENGINE": engine,
        "NAME": "dlock",
        "HOST": server["host"],
        "PORT": server["port"],
        "USER": server["user"],
        "PASSWORD": server["password"],
        "TEST": {"NAME": f"test_dlock_{os.getpid()}"},
    }
    if options:
        entry["OPTIONS"] = options
    return entry


def _unreachable(label: str, server: dict[str, Any], env: str) -> str:
    return (
        f"{label} is not reachable at {server['host']}:{server['port']} "
        f"(set DLOCK_TEST_{env}_HOST/PORT)"
    )


if port_open(PG["host"], PG["port"]):
    DATABASES["postgresql"] = _server_database("django.db.backends.postgresql", PG)
else:
    UNAVAILABLE_BACKENDS["db-postgresql"] = _unreachable("PostgreSQL", PG, "PG")

if port_open(MYSQL["host"], MYSQL["port"]):
    DATABASES["mysql"] = _server_database("django.db.backends.mysql", MYSQL, charset="utf8mb4")
    DATABASES["mysql"]["TEST"]["CHARSET"] = "utf8mb4"
else:
    UNAVAILABLE_BACKENDS["db-mysql"] = _unreachable("MariaDB/MySQL", MYSQL, "MYSQL")

if REQUIRE_ALL and UNAVAILABLE_BACKENDS:
    raise RuntimeError(
        "DLOCK_REQUIRE_ALL_BACKENDS=1 but: " + "; ".join(UNAVAILABLE_BACKENDS.values())
    )

_DB = "django_dlock.backends.database.DatabaseBackend"
DLOCK_BACKENDS = {
    "default": {"BACKEND": _DB},
    "locmem": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"},
    "db-sqlite": {"BACKEND": _DB, "OPTIONS": {"database": "default"}},
}
if "postgresql" in DATABASES:
    DLOCK_BACKENDS["db-postgresql"] = {"BACKEND": _DB, "OPTIONS": {"database": "postgresql"}}
if "mysql" in DATABASES:
    DLOCK_BACKENDS["db-mysql"] = {"BACKEND": _DB, "OPTIONS": {"database": "mysql"}}

# Redis: the tests start their own servers on these ports (tests/servers.py);
# nothing is listening yet when this module is imported.
_REDIS = "django_dlock.backends.redis.RedisBackend"
# The ports go into the environment, so that processes the tests start (Celery
# workers) import these settings with the same ones.
REDIS_PORTS = _shared_ports(
    "DLOCK_TEST_REDIS_PORTS",
    lambda: {
        "single": free_port(),
        "cluster": [free_port() for _ in range(3)],
        "redlock": [free_port() for _ in range(3)],
    },
)
if shutil.which("redis-server") and shutil.which("redis-cli"):
    _single = f"redis://127.0.0.1:{REDIS_PORTS['single']}/0"
    DLOCK_BACKENDS.update(
        {
            "redis": {"BACKEND": _REDIS, "LOCATION": _single},
            "redis-fair": {"BACKEND": _REDIS, "LOCATION": _single, "OPTIONS": {"fair": True}},
            "redis-cluster": {
                "BACKEND": _REDIS,
                "LOCATION": f"redis://127.0.0.1:{REDIS_PORTS['cluster'][0]}/0",
                "OPTIONS": {"cluster": True},
            },
            # Redlock over three masters; the tests keep the third one stopped.
            "redlock": {
                "BACKEND": "django_dlock.backends.redis.RedlockBackend",
                "LOCATION": [f"redis://127.0.0.1:{p}/0" for p in REDIS_PORTS["redlock"]],
            },
            "redis-django": {
                "BACKEND": _REDIS,
                "OPTIONS": {"connection": "django-redis:locks"},
            },
        }
    )
    CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "locks": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": _single},
    }
else:
    for _alias in ("redis", "redis-fair", "redis-cluster", "redlock"):
        UNAVAILABLE_BACKENDS[_alias] = "redis-server and redis-cli are not installed"
    if REQUIRE_ALL:
        raise RuntimeError("DLOCK_REQUIRE_ALL_BACKENDS=1 but redis-server is not installed")

# etcd: the tests start their own members on these (client, peer) ports.
_ETCD = "django_dlock.backends.etcd.EtcdBackend"
ETCD_PORTS = _shared_ports(
    "DLOCK_TEST_ETCD_PORTS",
    lambda: {
        "single": (free_port(), free_port()),
        "cluster": [(free_port(), free_port()) for _ in range(3)],
    },
)
if shutil.which("etcd") and shutil.which("etcdctl"):
    DLOCK_BACKENDS.update(
        {
            "etcd": {"BACKEND": _ETCD, "LOCATION": f"127.0.0.1:{ETCD_PORTS['single'][0]}"},
            "etcd-cluster": {
                "BACKEND": _ETCD,
                "LOCATION": [f"127.0.0.1:{client}" for client, _ in ETCD_PORTS["cluster"]],
            },
        }
    )
else:
    for _alias in ("etcd", "etcd-cluster"):
        UNAVAILABLE_BACKENDS[_alias] = "etcd and etcdctl are not installed (apt: etcd-server)"
    if REQUIRE_ALL:
        raise RuntimeError("DLOCK_REQUIRE_ALL_BACKENDS=1 but etcd is not installed")

# ZooKeeper: the tests start their own servers on these (client, quorum,
# election) ports: a standalone one and a 3-server ensemble. Sessions of 2 s
# (the servers tick every 100 ms), so that a dead holder's locks go in time.
_ZK = "django_dlock.backends.zookeeper.ZooKeeperBackend"
ZK_PORTS = _shared_ports(
    "DLOCK_TEST_ZK_PORTS",
    lambda: {
        "single": [(free_port(), free_port(), free_port())],
        "ensemble": [(free_port(), free_port(), free_port()) for _ in range(3)],
    },
)
if zookeeper_installed() and find_spec("kazoo") is not None:
    DLOCK_BACKENDS.update(
        {
            "zookeeper": {
                "BACKEND": _ZK,
                "LOCATION": f"127.0.0.1:{ZK_PORTS['single'][0][0]}",
                "OPTIONS": {"session_timeout": 2.0},
            },
            "zookeeper-ensemble": {
                "BACKEND": _ZK,
                "LOCATION": "zk://"
                + ",".join(f"127.0.0.1:{client}" for client, _, _ in ZK_PORTS["ensemble"])
                + "/dlock-tests",
                "OPTIONS": {"session_timeout": 2.0},
            },
        }
    )
else:
    for _alias in ("zookeeper", "zookeeper-ensemble"):
        UNAVAILABLE_BACKENDS[_alias] = (
            "ZooKeeper (apt: zookeeperd, and Java) or kazoo is not installed"
        )
    if REQUIRE_ALL:
        raise RuntimeError("DLOCK_REQUIRE_ALL_BACKENDS=1 but ZooKeeper or kazoo is not installed")

# The example backend of docs/development.md ("Write a backend").
DLOCK_BACKENDS["example"] = {
    "BACKEND": "tests.example_backend.SQLiteFileBackend",
    "LOCATION": os.path.join(_TMP, "example-locks.sqlite3"),
}

#: conformance alias -> the DATABASES alias its tests need (None: no database)
CONFORMANCE_BACKENDS = {
    "locmem": None,
    "example": None,
    "db-sqlite": "default",
    "db-postgresql": "postgresql",
    "db-mysql": "mysql",
    "redis": None,
    "redis-fair": None,
    "redis-cluster": None,
    "redlock": None,
    "etcd": None,
    "etcd-cluster": None,
    "zookeeper": None,
    "zookeeper-ensemble": None,
}

# Celery: the tests' tasks (tests/tasks.py) lock on the "celery" alias, which is
# DLOCK_TEST_CELERY_LOCKS's backend (Redis by default). Eager tests use the
# in-memory transport; tests that start a worker pass it a real broker.
DLOCK_BACKENDS["celery"] = dict(DLOCK_BACKENDS[os.environ.get("DLOCK_TEST_CELERY_LOCKS", "redis")])
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "memory://")
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any] = {}
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", "cache+memory://")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get(
    "DLOCK_TEST_CELERY_QUEUE", f"dlock-tests-{_XDIST_WORKER}" if _XDIST_WORKER else "dlock-tests"
)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# Django's task framework (django_dlock.task_framework): Django 6's django.tasks, or the
# django-tasks package before it. "default" runs each task at once, in
# enqueue(); "db" is django-tasks-db's queue, which tests/test_django_tasks.py
# runs with real `db_worker` processes.
if find_spec("django.tasks") is not None:
    TASKS_FRAMEWORK: str | None = "django.tasks"
elif find_spec("django_tasks") is not None:
    TASKS_FRAMEWORK = "django_tasks"
else:
    TASKS_FRAMEWORK = None
if TASKS_FRAMEWORK is not None:
    TASKS: dict[str, Any] = {
        "default": {"BACKEND": f"{TASKS_FRAMEWORK}.backends.immediate.ImmediateBackend"},
        # Keeps what is enqueued and runs nothing: a queued call's ticket stays.
        "dummy": {"BACKEND": f"{TASKS_FRAMEWORK}.backends.dummy.DummyBackend"},
    }
    if find_spec("django_tasks_db") is not None:
        INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]
        TASKS["db"] = {"BACKEND": "django_tasks_db.DatabaseBackend"}
