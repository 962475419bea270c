"""No message shows a secret from a setting (issue 29, item 6).

A password goes in every place a setting can hold one, and is looked for in
every check message, error, ``repr``, log line and ``manage.py locks`` output,
with servers that refuse connections, never answer, or refuse the password.
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
