"""Health probes against real servers the tests start and kill.

- ``django_dlock.contrib.health_check`` in django-health-check's view: 200
  while every lock backend answers, 500 naming the one that does not (a
  killed redis-server or etcd, a server that accepts connections and never
  answers), 200 again once it is back.
- ``manage.py locks check`` as a Kubernetes ``exec`` probe runs it: exit 0
  while the server is up, 3 once it is stopped, 0 after its restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.test import Client, override_settings

pytest.importorskip(
    "health_check", reason="django-health-check is not installed (pip install -e '.[health]')"
)

from asgiref.sync import async_to_sync
from django.test import RequestFactory
from health_check.base import HealthCheck
from health_check.views import HealthCheckView

from django_dlock.contrib.health_check import LockBackend, lock_backend_checks
from tests.health_urls import TIMEOUT
from tests.servers import EtcdServer, RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
DB = {"BACKEND": "django_dlock.backends.database.DatabaseBackend"}
REDIS = "django_dlock.backends.redis.RedisBackend"
ETCD = "django_dlock.backends.etcd.EtcdBackend"
JSON = {"HTTP_ACCEPT": "application/json"}

needs_redis = pytest.mark.skipif(
    not shutil.which("redis-server"), reason="redis-server is not installed"
)
needs_etcd = pytest.mark.skipif(
    not (shutil.which("etcd") and shutil.which("etcdctl")),
    reason="etcd is not installed (apt: etcd-server)",
)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port()).start()
    yield server
    server.cleanup()


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    client, peer = free_port(), free_port()
    server = EtcdServer("health", client, peer, {"health": peer}).start()
    yield server
    server.cleanup()


def health(backends: dict[str, dict[str, object]]) -> override_settings:
    return override_settings(DLOCK_BACKENDS=backends, ROOT_URLCONF="tests.health_urls")


def get(client: Client) -> tuple[int, dict[str, str], float]:
    """The status, the JSON body (check -> "OK" or its error) and how long it took."""
    started = time.monotonic()
    response = client.get("/health/", **JSON)
    return response.status_code, response.json(), time.monotonic() - started


@needs_redis
@pytest.mark.django_db(transaction=True)
def test_200_while_up_500_naming_the_killed_redis_200_after_restart(
    redis_server: RedisServer,
) -> None:
    backends = {"default": DB, "redis": {"BACKEND": REDIS, "LOCATION": redis_server.url}}
    with health(backends):
        client = Client()
        status, body, _ = get(client)
        assert (status, body) == (
            200,
            {"LockBackend(alias='default')": "OK", "LockBackend(alias='redis')": "OK"},
        )

        redis_server.kill()
        status, body, _ = get(client)
        assert status == 500
        assert body["LockBackend(alias='default')"] == "OK"
        error = body["LockBackend(alias='redis')"]
        assert error.startswith("Unavailable: lock backend 'redis': Redis at redis://127.0.0.1:")
        # As text (an HTTP probe that logs the body): one line a check.
        text = client.get("/health/", {"format": "text"})
        assert text.status_code == 500
        assert f"LockBackend(alias='redis'): {error}\n" in text.content.decode()

        redis_server.start()
        status, body, _ = get(client)
        assert status == 200, body


@needs_etcd
@pytest.mark.django_db(transaction=True)
def test_500_naming_a_killed_etcd(etcd_server: EtcdServer) -> None:
    backends = {"default": DB, "etcd": {"BACKEND": ETCD, "LOCATION": etcd_server.endpoint}}
    with health(backends):
        client = Client()
        status, body, _ = get(client)
        assert status == 200, body
        etcd_server.kill()
        status, body, _ = get(client)
        assert status == 500
        assert body["LockBackend(alias='default')"] == "OK"
        # etcd's client waits for the server to come back for its whole
        # ``timeout`` (5 s), so the check's own bound (3 s here) answers first.
        assert body["LockBackend(alias='etcd')"].startswith("Unavailable: lock backend 'etcd'")


@contextlib.contextmanager
def black_hole() -> Iterator[int]:
    """A port whose server accepts connections (the kernel's backlog) and never answers."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    try:
        yield listener.getsockname()[1]
    finally:
        # The waiting clients are reset: their pings end, and their threads.
        listener.close()


@needs_redis
@pytest.mark.django_db(transaction=True)
def test_a_server_that_never_answers_fails_the_check_within_its_timeout() -> None:
    with black_hole() as port:
        # The Redis client's own socket timeout (5 s) is longer than the check's.
        backends = {
            "default": DB,
            "redis": {"BACKEND": REDIS, "LOCATION": f"redis://127.0.0.1:{port}/0"},
        }
        with health(backends):
            client = Client()
            status, body, took = get(client)
            assert status == 500
            assert body["LockBackend(alias='default')"] == "OK"
            limit = TIMEOUT.total_seconds()
            assert body["LockBackend(alias='redis')"].startswith(
                f"Unavailable: lock backend 'redis' did not answer a ping within {limit:g} s"
            )
            # A probe while that ping still waits waits for it, and starts no other.
            status, body, took_again = get(client)
            assert status == 500
            assert "did not answer a ping within" in body["LockBackend(alias='redis')"]
            pings = [t.name for t in threading.enumerate() if t.name.startswith("dlock-ping")]
            assert pings == ["dlock-ping:redis"]
            # Not a speed test: the ping itself gives up only after 10 s (the
            # client's 5 s socket timeout, twice), and so would the response
            # if it waited for the ping's thread.
            assert took < 8 and took_again < 8


@dataclasses.dataclass
class _Stuck(HealthCheck):
    """A synchronous check that outlasts its timeout, as a ping to a silent server does."""

    timeout = datetime.timedelta(seconds=1)

    def run(self) -> None:
        threading.Event().wait(4)


def test_why_the_ping_has_a_thread_of_its_own() -> None:
    """django-health-check runs a synchronous check on the event loop's executor.

    Under WSGI (as the test client runs views) the view runs in
    ``asyncio.run()``, which waits for that executor's threads on its way
    out: the body says the check timed out after 1 s, but it is sent only
    when the check returns. If this fails, django-health-check no longer
    holds the response, and LockBackend's own thread may not be needed.
    """
    view = HealthCheckView.as_view(checks=[_Stuck])
    started = time.monotonic()
    response = async_to_sync(view)(RequestFactory().get("/", **JSON))
    took = time.monotonic() - started
    assert json.loads(response.content) == {"_Stuck()": "Unavailable: Timed out after 1 seconds"}
    assert took >= 3.5


@override_settings(DLOCK_BACKENDS={"default": DB})
def test_an_unknown_alias_fails_its_check_by_name() -> None:
    view = HealthCheckView.as_view(checks=[(LockBackend, {"alias": "nope"})])
    response = async_to_sync(view)(RequestFactory().get("/", **JSON))
    assert response.status_code == 500
    assert json.loads(response.content) == {
        "LockBackend(alias='nope')": "Unavailable: lock backend 'nope' is misconfigured: "
        "No lock backend 'nope' in DLOCK_BACKENDS; configured: ['default']."
    }


@override_settings(DLOCK_BACKENDS={"default": DB, "redis": {"BACKEND": REDIS}})
def test_lock_backend_checks_names_every_alias_and_passes_options() -> None:
    assert lock_backend_checks(timeout=TIMEOUT) == [
        (LockBackend, {"alias": "default", "timeout": TIMEOUT}),
        (LockBackend, {"alias": "redis", "timeout": TIMEOUT}),
    ]


def test_without_django_health_check_only_the_contrib_module_fails_to_import() -> None:
    # None in sys.modules makes any import of it fail, as if not installed.
    code = (
        "import sys; sys.modules['health_check'] = None\n"
        "import django; django.setup()\n"
        "import django_dlock, django_dlock.contrib, django_dlock.handler\n"
        "try:\n"
        "    import django_dlock.contrib.health_check\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "testproject")])
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "django_dlock.contrib.health_check needs django-health-check 4.8 or later "
        "(pip install 'django-dlock[health]').\n"
    )


# --- manage.py locks check, as a Kubernetes exec probe runs it --------------------------------


def probe(settings_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(settings_dir), str(ROOT), str(ROOT / "testproject")])
    return subprocess.run(
        [sys.executable, "-m", "django", "locks", "check", *args],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "probe_settings", "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_redis
def test_locks_check_exits_0_while_up_3_once_stopped_0_after_restart(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    backends = {"default": {"BACKEND": REDIS, "LOCATION": redis_server.url}}
    (tmp_path / "probe_settings.py").write_text(
        f"from tests.settings import *  # noqa\nDLOCK_BACKENDS = {backends!r}\n"
    )
    result = probe(tmp_path, "--backend", "default")
    assert result.returncode == 0, result.stderr
    assert "Redis " in result.stdout

    redis_server.stop()
    result = probe(tmp_path, "--backend", "default")
    assert result.returncode == 3
    assert "FAILED" in result.stdout
    assert result.stderr.endswith(
        "CommandError: Backend(s) default did not answer, or cannot lock: see above.\n"
    )

    redis_server.start()
    result = probe(tmp_path, "--backend", "default")
    assert result.returncode == 0, result.stderr


@needs_redis
def test_locks_check_timeout_counts_a_silent_server_as_down(tmp_path: Path) -> None:
    """Without --timeout the probe would wait 10 s (the Redis client's own timeouts)."""
    with black_hole() as port:
        backends = {"default": {"BACKEND": REDIS, "LOCATION": f"redis://127.0.0.1:{port}/0"}}
        (tmp_path / "probe_settings.py").write_text(
            f"from tests.settings import *  # noqa\nDLOCK_BACKENDS = {backends!r}\n"
        )
        started = time.monotonic()
        result = probe(tmp_path, "--backend", "default", "--timeout", "1")
        took = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    assert "did not answer a ping within 1 s" in result.stdout
    # Not a speed test: the process exits after its 1 s, not after the 10 s ping.
    assert took < 9


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf", "1e10"])
def test_locks_check_refuses_a_timeout_that_is_not_positive_seconds(
    value: str, tmp_path: Path
) -> None:
    (tmp_path / "probe_settings.py").write_text("from tests.settings import *  # noqa\n")
    result = probe(tmp_path, "--backend", "locmem", "--timeout", value)
    assert result.returncode == 2
    assert "must be a positive number of seconds" in result.stderr


@needs_redis
def test_a_forked_child_starts_its_own_ping() -> None:
    """The parent's ping under way has no thread in the child: the child must not wait on it."""
    from django_dlock import locks
    from django_dlock.exceptions import BackendUnavailable
    from django_dlock.pings import ping_within

    with black_hole() as port:
        backends = {
            "default": DB,
            "silent": {"BACKEND": REDIS, "LOCATION": f"redis://127.0.0.1:{port}/0"},
        }
        with override_settings(DLOCK_BACKENDS=backends):
            backend = locks["silent"]
            with pytest.raises(BackendUnavailable):
                ping_within(backend, 1.5)  # the parent's ping goes on waiting
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    try:
                        ping_within(backend, 0.5)
                    except BackendUnavailable as e:
                        os.write(write, str(e).encode())
                finally:
                    os._exit(0)
            os.close(write)
            os.waitpid(pid, 0)
            message = os.read(read, 1000).decode()
            os.close(read)
    # Its own ping, about 0.5 s old, not the parent's (1.5 s and more).
    started = re.search(r"the ping started ([0-9.]+) s ago", message)
    assert started is not None, message
    assert float(started.group(1)) < 1.5, message


def test_a_finished_ping_is_never_handed_to_the_next_probe() -> None:
    """CI: the probe right after an etcd kill answered 200. The ping thread sets its
    result, then forgets the call: a probe in between was handed the finished
    ping of the server as it was before, not a new one."""
    from django_dlock import locks
    from django_dlock.pings import ping_in_thread

    backend = locks["locmem"]
    reused = 0
    for _ in range(300):
        first, _ = ping_in_thread(backend)
        first.result(5)
        second, _ = ping_in_thread(backend)
        reused += second is first
        second.result(5)
    assert reused == 0
