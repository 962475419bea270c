"""A project on PostgreSQL, run as its users run it: `manage.py test`, and a threaded server.

Issue 27: inside ``atomic()`` the database backend locked on a private
connection that nothing closed. ``manage.py test`` then failed to drop the
test database ("being accessed by other users", exit 1, the database left
behind), and under ``ATOMIC_REQUESTS`` the connections piled up (27 idle
after 40 concurrent requests, 0 without it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ROOT / "tests" / "pgtestproject"
PG = settings.PG


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(
        host=PG["host"], port=PG["port"], user=PG["user"], password=PG["password"] or None,
        dbname="postgres", autocommit=True,
    )  # fmt: skip


def _drop(admin: psycopg.Connection[tuple[object, ...]], name: str) -> None:
    admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [name]
    )
    admin.execute(f'DROP DATABASE IF EXISTS "{name}"')


def _exists(admin: psycopg.Connection[tuple[object, ...]], name: str) -> bool:
    return (
        admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        is not None
    )


def _sessions(admin: psycopg.Connection[tuple[object, ...]], name: str) -> int:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [name]
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def project_db() -> Iterator[str]:
    """A database of the project's own, migrated; dropped afterwards with its test database."""
    reason = settings.UNAVAILABLE_BACKENDS.get("db-postgresql")
    if reason:
        if settings.REQUIRE_ALL:
            pytest.fail(reason)
        pytest.skip(reason)
    name = f"dlock_pgtp_{os.getpid()}"
    with _admin() as admin:
        _drop(admin, name)
        _drop(admin, f"test_{name}")
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        _manage(name, "migrate", "--noinput", "-v", "0").check_returncode()
        yield name
    finally:
        with _admin() as admin:
            _drop(admin, name)
            _drop(admin, f"test_{name}")


def _env(name: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(PROJECT)]),
        "DJANGO_SETTINGS_MODULE": "pgtestproject.settings",
        "DLOCK_PGTP_DB": name,
        **extra,
    }


def _manage(name: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT, env=_env(name, **extra), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_manage_py_test_on_postgresql_drops_its_test_database(project_db: str) -> None:
    """Its TestCases take locks, semaphores and an rwlock, inside Django's transactions."""
    result = _manage(project_db, "test", "pgapp", "--noinput")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Ran 4 tests" in output and "OK" in output
    with _admin() as admin:
        assert not _exists(admin, f"test_{project_db}"), output


def _serve(name: str, atomic: bool, max_age: int, requests: int, pk: int, floor: int) -> int:
    """Serve ``requests`` concurrent increments; the sessions left on the database after.

    Waits (10 s at most) for the count to come down to ``floor``.
    """
    server = subprocess.Popen(
        [sys.executable, "serve.py"],
        cwd=PROJECT,
        env=_env(
            name,
            DLOCK_PGTP_ATOMIC_REQUESTS="1" if atomic else "0",
            DLOCK_PGTP_CONN_MAX_AGE=str(max_age),
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())

        def get(_: int) -> int:
            url = f"http://127.0.0.1:{port}/increment/{pk}/"
            with urllib.request.urlopen(url, timeout=120) as response:
                return int(response.status)

        with ThreadPoolExecutor(requests) as pool:
            assert set(pool.map(get, range(requests))) == {200}
        with _admin() as admin:
            # The last connections close just after the last answers went out.
            deadline = time.monotonic() + 10
            left = _sessions(admin, name)
            while left > floor and time.monotonic() < deadline:
                time.sleep(0.1)
                left = _sessions(admin, name)
            return left
    finally:
        server.kill()
        server.wait(timeout=30)


@pytest.mark.parametrize("max_age", [0, 60])
def test_atomic_requests_leave_no_more_connections_than_without(
    project_db: str, max_age: int
) -> None:
    """40 concurrent requests on 8 server threads, each locking inside the request's transaction.

    With CONN_MAX_AGE=0 every connection closes at the end of its request;
    with 60 each server thread keeps its own (at most 8), and no more.
    """
    with psycopg.connect(
        host=PG["host"], port=PG["port"], user=PG["user"], password=PG["password"] or None,
        dbname=project_db, autocommit=True,
    ) as db:  # fmt: skip
        row = db.execute("INSERT INTO pgapp_counter (value) VALUES (0) RETURNING id").fetchone()
        assert row is not None
        pk = int(row[0])
    floor = 0 if max_age == 0 else 8
    left = {atomic: _serve(project_db, atomic, max_age, 40, pk, floor) for atomic in (False, True)}
    print(f"\n[CONN_MAX_AGE={max_age}] sessions left after 40 requests: {left}")
    assert left[True] <= left[False] <= floor
    with psycopg.connect(
        host=PG["host"], port=PG["port"], user=PG["user"], password=PG["password"] or None,
        dbname=project_db, autocommit=True,
    ) as db:  # fmt: skip
        row = db.execute("SELECT value FROM pgapp_counter WHERE id = %s", [pk]).fetchone()
    assert row is not None and row[0] == 80  # no update lost, with or without
