"""Settings that pass the checks work; none that fail later passes; no message shows a secret.

Issue 29, items 2 and 6. Each bad value below used to pass ``manage.py check``
and then end ``manage.py locks`` in a traceback (or crash the check itself);
each secret below used to reach a check message or an error.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_dlock import locks
from django_dlock.checks import check_backends
from django_dlock.exceptions import BackendUnavailable, LockConfigurationError
from tests.servers import RedisServer, free_port

REDIS = "django_dlock.backends.redis.RedisBackend"
REDLOCK = "django_dlock.backends.redis.RedlockBackend"
ETCD = "django_dlock.backends.etcd.EtcdBackend"
LOCMEM = {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}
SECRET = "s3cr3t-XYZ"
#: Bounded waits against a server that never answers.
FAST_REDIS = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}


def run_locks(*args: str) -> str:
    """What ``manage.py locks ARGS`` prints, and its CommandError's message if it fails.

    Anything else it raises (a traceback for the user) fails the test.
    """
    out, err = StringIO(), StringIO()
    try:
        call_command("locks", *args, stdout=out, stderr=err, no_color=True)
    except CommandError as e:
        return f"{out.getvalue()}{err.getvalue()}CommandError: {e}"
    return out.getvalue() + err.getvalue()


# --- item 2: what fails at run time fails the checks ---------------------------------------

R = "redis://127.0.0.1:6379/0"
BAD = {
    "redis port out of range": {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:99999/0"},
    "redis port not a number": {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:abc/0"},
    "redis port 0": {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:0/0"},
    "redis no host": {"BACKEND": REDIS, "LOCATION": "redis://:6379/0"},
    "redis db not a number": {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:6379/x"},
    "redis db query": {"BACKEND": REDIS, "LOCATION": f"{R}?db=x"},
    "redis unknown query": {"BACKEND": REDIS, "LOCATION": f"{R}?sockettimeout=1"},
    "redis query timeout inf": {"BACKEND": REDIS, "LOCATION": f"{R}?socket_timeout=inf"},
    "redis unix without path": {"BACKEND": REDIS, "LOCATION": "unix://"},
    "redis cluster db 1": {
        "BACKEND": REDIS,
        "LOCATION": "redis://127.0.0.1:6379/1",
        "OPTIONS": {"cluster": True},
    },
    "redis unknown client_kwargs": {
        "BACKEND": REDIS,
        "LOCATION": R,
        "OPTIONS": {"client_kwargs": {"sockettimeout": 1}},
    },
    "redis ssl client_kwargs on redis://": {
        "BACKEND": REDIS,
        "LOCATION": R,
        "OPTIONS": {"client_kwargs": {"ssl_certfile": "/x.pem"}},
    },
    "redis cluster unknown client_kwargs": {
        "BACKEND": REDIS,
        "LOCATION": R,
        "OPTIONS": {"cluster": True, "client_kwargs": {"passwrd": "x"}},
    },
    "redis client_kwargs timeout": {
        "BACKEND": REDIS,
        "LOCATION": R,
        "OPTIONS": {"client_kwargs": {"socket_timeout": "5"}},
    },
    "redis client_kwargs max_connections": {
        "BACKEND": REDIS,
        "LOCATION": R,
        "OPTIONS": {"client_kwargs": {"max_connections": "10"}},
    },
    "redis client_kwargs retry": {
        "BACKEND": REDIS,
        "LOCATION": R,
        "OPTIONS": {"client_kwargs": {"retry": 5}},
    },
    "redis client_kwargs connection_class": {
        "BACKEND": REDIS,
        "LOCATION": R,
        "OPTIONS": {"client_kwargs": {"connection_class": "redis.connection.Connection"}},
    },
    "redis ssl_cert_reqs": {
        "BACKEND": REDIS,
        "LOCATION": "rediss://127.0.0.1:6380/0?ssl_cert_reqs=bogus",
    },
    "redlock one master's port": {
        "BACKEND": REDLOCK,
        "LOCATION": [R, "redis://127.0.0.1:70000/0", R],
    },
    "etcd port out of range": {"BACKEND": ETCD, "LOCATION": "127.0.0.1:99999"},
    "etcd scheme": {"BACKEND": ETCD, "LOCATION": "etcd://127.0.0.1:2379"},
    "etcd userinfo": {"BACKEND": ETCD, "LOCATION": "http://root:pw@127.0.0.1:2379"},
    "etcd timeout inf": {"BACKEND": ETCD, "OPTIONS": {"timeout": float("inf")}},
}
# The review's cases: each passed the checks, then failed every call.
for key, value in [
    ("ssl_min_version", "TLSv1_2"),
    ("protocol", 4),
    ("client_name", "has space"),
    ("client_name", "new\nline"),
    ("socket_keepalive_options", {999: 1}),
    ("socket_keepalive_options", {socket.TCP_KEEPIDLE: "1"}),
    ("health_check_interval", float("inf")),
    ("socket_keepalive_options", {socket.TCP_KEEPIDLE: 0}),
    ("socket_keepalive_options", {socket.TCP_KEEPIDLE: 2**31}),
    ("socket_keepalive_options", {socket.TCP_INFO: 1}),
    ("socket_read_size", 0),
    ("socket_type", 99),
    ("credential_provider", "x"),
    ("lib_name", 5),
    ("driver_info", "x"),
]:
    BAD[f"redis client_kwargs {key}={value!r}"] = {
        "BACKEND": REDIS,
        "LOCATION": R,
        "OPTIONS": {"client_kwargs": {key: value}},
    }
for key in ("socket_timeout", "socket_connect_timeout"):
    for value in (float("inf"), float("nan"), -1, 0, True, "5"):
        BAD[f"redis {key}={value!r}"] = {
            "BACKEND": REDIS,
            "LOCATION": R,
            "OPTIONS": {key: value},
        }


@pytest.mark.parametrize("params", list(BAD.values()), ids=list(BAD))
def test_a_setting_that_would_fail_at_run_time_fails_the_check(params: dict[str, Any]) -> None:
    setting = {"default": LOCMEM, "bad": params}
    with override_settings(DLOCK_BACKENDS=setting):
        errors = [e for e in check_backends() if e.is_serious()]
        assert [e.id for e in errors] == ["django_dlock.E006"], errors
        assert "'bad'" in errors[0].msg
        with pytest.raises(LockConfigurationError) as excinfo:
            locks["bad"]
        assert excinfo.value.check_id == "django_dlock.E006"
        for args in (("check",), ()):
            output = run_locks(*args)
            assert "CommandError" in output and "'bad'" in output, output


def test_socket_timeout_inf_does_not_crash_manage_py_check() -> None:
    bad = {"BACKEND": REDIS, "LOCATION": R, "OPTIONS": {"socket_timeout": float("inf")}}
    with override_settings(DLOCK_BACKENDS={"default": LOCMEM, "bad": bad}):
        out, err = StringIO(), StringIO()
        with pytest.raises(Exception) as excinfo:
            call_command("check", stdout=out, stderr=err)
        assert type(excinfo.value).__name__ == "SystemCheckError"
        assert "django_dlock.E006" in str(excinfo.value)


@pytest.mark.parametrize("backend", [REDIS, REDLOCK])
@pytest.mark.parametrize("key", ["ssl_ca_certs", "ssl_certfile", "ssl_keyfile"])
def test_a_missing_tls_file_is_a_check_error(backend: str, key: str) -> None:
    urls = ["rediss://127.0.0.1:6380/0"] * (3 if backend == REDLOCK else 1)
    kwargs = {"ssl_certfile": __file__, "ssl_keyfile": __file__, key: "/nowhere/tls.pem"}
    params = {"BACKEND": backend, "LOCATION": urls, "OPTIONS": {"client_kwargs": kwargs}}
    if backend == REDIS:
        params["LOCATION"] = urls[0]
    with override_settings(DLOCK_BACKENDS={"default": LOCMEM, "tls": params}):
        errors = [e for e in check_backends() if e.is_serious()]
    assert [e.id for e in errors] == ["django_dlock.E006"], errors
    assert key in errors[0].msg and "'tls'" in errors[0].msg


@pytest.mark.parametrize(
    "params",
    [
        {"BACKEND": REDIS, "LOCATION": f"{R}?socket_keepalive=true&health_check_interval=5"},
        {"BACKEND": REDIS, "LOCATION": "unix:///tmp/redis.sock?db=2"},
        {"BACKEND": REDIS, "LOCATION": "rediss://127.0.0.1:6380/0?ssl_cert_reqs=none"},
        {
            "BACKEND": REDIS,
            "LOCATION": "rediss://127.0.0.1:6380/0",
            "OPTIONS": {"client_kwargs": {"ssl_ca_certs": __file__, "username": "u"}},
        },
        {
            "BACKEND": REDIS,
            "LOCATION": R,
            "OPTIONS": {"cluster": True, "client_kwargs": {"max_connections": 5}},
        },
        {"BACKEND": ETCD, "LOCATION": ["127.0.0.1:2379", "http://[::1]:2380/"]},
        {
            "BACKEND": REDIS,
            "LOCATION": R,
            "OPTIONS": {
                "client_kwargs": {
                    "health_check_interval": 1.5,
                    "protocol": 3,
                    "client_name": "billing-worker",
                    "socket_keepalive_options": {socket.TCP_KEEPIDLE: 30},
                }
            },
        },
        {
            "BACKEND": REDIS,
            "LOCATION": "rediss://127.0.0.1:6380/0?ssl_min_version=771&ssl_cert_reqs=none",
        },
        {
            "BACKEND": REDIS,
            "LOCATION": R,
            "OPTIONS": {"client_kwargs": {"socket_type": socket.AF_INET, "lib_name": "x"}},
        },
    ],
)
def test_good_settings_still_pass(params: dict[str, Any]) -> None:
    with override_settings(DLOCK_BACKENDS={"default": LOCMEM, "ok": params}):
        assert [e for e in check_backends() if e.is_serious()] == []
        locks["ok"]


# --- item 6: no secret in any message ---------------------------------------------------


@pytest.fixture(scope="module")
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


@pytest.fixture(scope="module")
def protected_redis() -> Iterator[RedisServer]:
    """A real Redis that wants another password than the one we send."""
    server = RedisServer(free_port(), "--requirepass", "the-right-one").start()
    yield server
    server.cleanup()


def redis_places(port: int) -> dict[str, dict[str, Any]]:
    """Every place a Redis setting can hold a password, on a server at ``port``."""
    at = f"127.0.0.1:{port}"
    fast = {"OPTIONS": dict(FAST_REDIS)}
    kwargs = {"OPTIONS": {**FAST_REDIS, "client_kwargs": {"password": SECRET}}}
    return {
        "url password": {"BACKEND": REDIS, "LOCATION": f"redis://:{SECRET}@{at}/0", **fast},
        "url user and password": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://me:{SECRET}@{at}/0",
            **fast,
        },
        "url password only, no colon": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://{SECRET}@{at}/0",
            **fast,
        },
        "url query password": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://{at}/0?password={SECRET}",
            **fast,
        },
        "url query password, its key percent-encoded": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://{at}/0?username=me&passw%6Frd={SECRET}",
            **fast,
        },
        "url query password with a ;": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://{at}/0?password=a;{SECRET}",
            **fast,
        },
        "url query password with an unescaped #": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://{at}/0?password=a#{SECRET}",
            **fast,
        },
        "url query password with an unescaped &": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://{at}/0?password=a&{SECRET}",
            **fast,
        },
        "client_kwargs password": {"BACKEND": REDIS, "LOCATION": f"redis://{at}/0", **kwargs},
        "redlock masters": {
            "BACKEND": REDLOCK,
            "LOCATION": [f"redis://:{SECRET}@{at}/{db}" for db in range(3)],
            **fast,
        },
        "redlock client_kwargs": {
            "BACKEND": REDLOCK,
            "LOCATION": [f"redis://{at}/{db}" for db in range(3)],
            **kwargs,
        },
        "cluster url password": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://:{SECRET}@{at}/0",
            "OPTIONS": {**FAST_REDIS, "cluster": True},
        },
        # Refused by the checks; the refusal must not show it either.
        "mistyped scheme": {"BACKEND": REDIS, "LOCATION": f"redsi://:{SECRET}@{at}/0"},
        "no scheme": {"BACKEND": REDIS, "LOCATION": f":{SECRET}@{at}/0"},
        "unescaped slash": {"BACKEND": REDIS, "LOCATION": f"redis://:a/{SECRET}@{at}/0"},
        "bad port": {"BACKEND": REDIS, "LOCATION": f"redis://:{SECRET}@127.0.0.1:99999/0"},
        "bad query": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://:{SECRET}@{at}/0?db=x&password={SECRET}",
        },
        "redlock bad master": {
            "BACKEND": REDLOCK,
            "LOCATION": [f"redis://:{SECRET}@{at}/0", f"redis://:{SECRET}@127.0.0.1:0/0"],
        },
        "ssl_password on redis://": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://{at}/0",
            "OPTIONS": {"client_kwargs": {"ssl_password": SECRET}},
        },
    }


def etcd_places(port: int) -> dict[str, dict[str, Any]]:
    at = f"127.0.0.1:{port}"
    return {
        "etcd user and password": {
            "BACKEND": ETCD,
            "LOCATION": at,
            "OPTIONS": {"user": "root", "password": SECRET, "timeout": 1},
        },
        "etcd url userinfo": {
            "BACKEND": ETCD,
            "LOCATION": f"http://root:{SECRET}@{at}",
            "OPTIONS": {"timeout": 1},
        },
        "etcd list with userinfo": {
            "BACKEND": ETCD,
            "LOCATION": [at, f"https://root:{SECRET}@{at}"],
            "OPTIONS": {"timeout": 1},
        },
        "etcd bad scheme": {"BACKEND": ETCD, "LOCATION": f"htp://root:{SECRET}@{at}"},
        "etcd bad port": {"BACKEND": ETCD, "LOCATION": f"http://root:{SECRET}@127.0.0.1:0"},
        "etcd password without user": {
            "BACKEND": ETCD,
            "LOCATION": at,
            "OPTIONS": {"password": SECRET},
        },
    }


#: The real server that refuses a password is a Redis.
CASES = [
    (place, server)
    for place in [*redis_places(1), *etcd_places(1)]
    for server in ("refuses connections", "never answers", "refuses the password")
    if not (place.startswith("etcd") and server == "refuses the password")
]


def _port(server: str, request: pytest.FixtureRequest) -> int:
    if server == "refuses connections":
        return free_port()
    if server == "never answers":
        port: int = request.getfixturevalue("silent_port")
        return port
    return int(request.getfixturevalue("protected_redis").port)


@pytest.mark.parametrize(("place", "server"), CASES)
def test_no_secret_in_any_message(
    place: str, server: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    port = _port(server, request)
    params = {**redis_places(port), **etcd_places(port)}[place]
    caplog.set_level(logging.DEBUG)
    shown: list[str] = []
    with override_settings(DLOCK_BACKENDS={"default": LOCMEM, "s": params}):
        messages = list(check_backends())
        shown += [f"{m.msg} {m.hint} {m.obj}" for m in messages]
        try:
            backend = locks["s"]
        except LockConfigurationError as e:
            shown.append(str(e))
            assert [m.id for m in messages if m.is_serious()], "refused, but not by a check"
            backend = None
        if backend is not None:
            shown.append(repr(backend))
            for call in (backend.ping, lambda: backend.acquire("n", timeout=0)):
                with pytest.raises(BackendUnavailable) as excinfo:
                    call()
                shown.append(str(excinfo.value))
        shown.append(run_locks("check"))
        shown.append(run_locks())
        locks.close_all()
    formatter = logging.Formatter()
    shown += [formatter.format(record) for record in caplog.records]
    leaked = [text for text in shown if SECRET in text or "cr3t" in text]
    assert not leaked
    assert shown


def test_client_kwargs_the_checks_accept_work_against_a_real_redis(
    redis_servers: dict[str, Any],
) -> None:
    from django.conf import settings

    from django_dlock import lock

    kwargs = {
        "health_check_interval": 1.5,
        "protocol": 3,
        "client_name": "billing-worker",
        "socket_keepalive": True,
        "socket_keepalive_options": {socket.TCP_KEEPIDLE: 30},
    }
    params = {
        "BACKEND": REDIS,
        "LOCATION": settings.DLOCK_BACKENDS["redis"]["LOCATION"],
        "OPTIONS": {"client_kwargs": kwargs},
    }
    with override_settings(DLOCK_BACKENDS={"default": LOCMEM, "ok": params}):
        assert [e for e in check_backends() if e.is_serious()] == []
        with lock("kwargs-that-work", backend="ok", timeout=0) as held:
            held.ensure()
        locks["ok"].ping()
