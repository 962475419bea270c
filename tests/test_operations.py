"""Operations that tell the truth (issue 29): the probe, django-dlock's own names,
what reaches a terminal, and the guard rails of ``manage.py locks``.

Real servers and real processes: a lock table not migrated, a Redis user
denied the scripts, a PostgreSQL session that is read-only, a reader that
closes the pipe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connections, transaction
from django.test import Client, override_settings

from django_dlock import (
    BackendUnavailable,
    LockLost,
    LockTimeout,
    lock,
    locks,
    semaphore,
)
from django_dlock._validation import INTERNAL_PREFIX, new_owner
from django_dlock.backends.base import BaseLockBackend
from django_dlock.backends.probe import PROBE_NAME
from django_dlock.exceptions import LockConfigurationError
from django_dlock.lag import LAG_PREFIX

ROOT = Path(__file__).resolve().parent.parent
LOCMEM = {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}
DB = {"BACKEND": "django_dlock.backends.database.DatabaseBackend"}
REDIS = "django_dlock.backends.redis.RedisBackend"
ESC = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x9b]")  # control characters but "\n" and "\t"


def run(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("locks", *args, stdout=out, stderr=err, no_color=True)
    return out.getvalue(), err.getvalue()


def failing(*args: str) -> tuple[CommandError, str, str]:
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError) as excinfo:
        call_command("locks", *args, stdout=out, stderr=err, no_color=True)
    return excinfo.value, out.getvalue(), err.getvalue()


def manage(
    tmp_path: Path, body: str, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m django locks ARGS`` with the test settings plus ``body``."""
    module = f"ops_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("from tests.settings import *  # noqa\n" + body)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": module,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "testproject")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "django", "locks", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- the probe ---------------------------------------------------------------------------


def test_the_probe_takes_and_releases_a_lease_that_no_listing_shows(
    backend_alias: str, backend: BaseLockBackend
) -> None:
    status = backend.ping()
    assert status.backend == backend_alias and status.version
    assert backend.do_get(PROBE_NAME) is None  # released
    assert not [i for i in backend.list() if i.name.startswith(INTERNAL_PREFIX)]
    with pytest.raises(ValueError, match="django-dlock's own"):
        lock(PROBE_NAME, backend=backend_alias).acquire(timeout=0)


@pytest.mark.backends("db-sqlite", "db-postgresql", "db-mysql")
def test_a_ping_inside_a_transaction_leaves_nothing_behind(
    backend_alias: str, backend: BaseLockBackend
) -> None:
    database = settings.CONFORMANCE_BACKENDS[backend_alias]
    with transaction.atomic(using=database):
        backend.ping()
        backend.ping()
    assert backend.do_get(PROBE_NAME) is None
    with lock("after-the-pings", backend=backend_alias, ttl=2) as held:
        held.ensure()


@pytest.mark.backends("db-sqlite", "db-postgresql", "db-mysql")
def test_a_ping_inside_a_transaction_while_another_probe_holds_the_name(
    backend_alias: str, backend: BaseLockBackend
) -> None:
    """On SQLite a held name inside atomic() is LockInTransaction: still an answer."""
    database = settings.CONFORMANCE_BACKENDS[backend_alias]
    owner: list[str] = []

    def other_probe() -> None:  # another connection: another thread's
        owner.append(new_owner())
        assert backend.do_acquire(PROBE_NAME, owner[0], 10, "{}", False) is not None
        connections.close_all()

    thread = threading.Thread(target=other_probe)
    thread.start()
    thread.join(10)
    try:
        with transaction.atomic(using=database):
            backend.ping()
    finally:
        backend.do_break(PROBE_NAME, None)


def test_a_lock_table_not_migrated_fails_the_probe_and_says_migrate(tmp_path: Path) -> None:
    body = (
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', "
        f"'NAME': {str(tmp_path / 'empty.sqlite3')!r}}}}}\n"
        f"DLOCK_BACKENDS = {{'default': {DB!r}}}\n"
    )
    result = manage(tmp_path, body, "check")
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "FAILED" in result.stdout
    assert "manage.py migrate" in result.stdout
    listed = manage(tmp_path, body)
    assert listed.returncode == 3
    assert "manage.py migrate" in listed.stderr
    # Nothing answered, so nothing is said to be free.
    assert "No locks held" not in listed.stdout


@pytest.fixture
def redis_url(redis_servers: dict[str, Any]) -> str:
    return str(settings.DLOCK_BACKENDS["redis"]["LOCATION"])


@contextlib.contextmanager
def acl_user(redis_url: str, denied: str, channels: list[str] | None = None) -> Iterator[str]:
    """The URL of a Redis ACL user who may run every command but the category ``denied``.

    On every key, and on the ``channels`` (by default all; Redis 7 gives a new user none).
    """
    client = redis.Redis.from_url(redis_url)
    user = f"ops{uuid.uuid4().hex[:8]}"
    client.acl_setuser(
        user,
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["*"] if channels is None else channels,
        reset_channels=True,
        commands=["+@all", f"-@{denied}"],
    )
    try:
        yield redis_url.replace("redis://", f"redis://{user}:pw@", 1)
    finally:
        client.acl_deluser(user)
        client.close()


@pytest.fixture
def no_scripts_user(redis_url: str) -> Iterator[str]:
    """May not run the scripts: NOPERM on EVALSHA."""
    with acl_user(redis_url, "scripting") as url:
        yield url


@pytest.fixture
def hardened_user(redis_url: str) -> Iterator[str]:
    """A common hardened ACL: no dangerous commands (INFO among them)."""
    with acl_user(redis_url, "dangerous") as url:
        yield url


def test_a_redis_user_denied_the_channels_fails_the_probe(redis_url: str, name: str) -> None:
    """Its lone locks work; the release a waiter waits for would fail on its PUBLISH."""
    with acl_user(redis_url, "dangerous", channels=[]) as url:
        backends = {"default": LOCMEM, "nochannels": {"BACKEND": REDIS, "LOCATION": url}}
        with override_settings(DLOCK_BACKENDS=backends):
            with pytest.raises(BackendUnavailable, match="may not publish") as excinfo:
                locks["nochannels"].ping()
            assert "&*" in str(excinfo.value)
            holder = lock(name, backend="nochannels").acquire()
            waiter = threading.Thread(target=_wait_for, args=(name, "nochannels"), daemon=True)
            waiter.start()
            time.sleep(0.5)  # it waits in the queue: the release wakes it by PUBLISH
            try:
                with pytest.raises(BackendUnavailable, match="channel"):
                    holder.release()
            finally:
                holder.release_quietly()
                waiter.join(10)


def _wait_for(name: str, alias: str) -> None:
    with contextlib.suppress(Exception):
        lock(name, backend=alias, timeout=3).acquire().release_quietly()


def test_a_redis_user_denied_info_but_not_the_scripts_passes_the_probe(
    hardened_user: str, name: str
) -> None:
    backends = {"default": LOCMEM, "hardened": {"BACKEND": REDIS, "LOCATION": hardened_user}}
    with override_settings(DLOCK_BACKENDS=backends):
        with lock(name, backend="hardened", timeout=0):
            pass  # it can lock: the probe must say so
        status = locks["hardened"].ping()
        assert "INFO is denied" in status.version
        out, _ = run("check", "--backend", "hardened")
        assert re.search(r"hardened .* ok", out)


@pytest.mark.django_db(transaction=True)
def test_a_redis_user_denied_the_scripts_fails_the_probe_and_the_health_check(
    no_scripts_user: str,
) -> None:
    pytest.importorskip("health_check", reason="django-health-check is not installed")
    backends = {"default": DB, "denied": {"BACKEND": REDIS, "LOCATION": no_scripts_user}}
    with override_settings(DLOCK_BACKENDS=backends, ROOT_URLCONF="tests.health_urls"):
        with pytest.raises(BackendUnavailable):
            lock("x", backend="denied").acquire(timeout=0)  # what the probe must agree with
        with pytest.raises(BackendUnavailable, match="no lock can be taken") as excinfo:
            locks["denied"].ping()
        assert "its ACL needs +@scripting" in str(excinfo.value)  # what to do
        error, out, _ = failing("check")
        assert error.returncode == 3
        assert "default" in out and "FAILED" in out
        response = Client().get("/health/", HTTP_ACCEPT="application/json")
        assert response.status_code == 500
        body = response.json()
        assert body["LockBackend(alias='default')"] == "OK"
        assert "no lock can be taken" in body["LockBackend(alias='denied')"]
        assert "pw@" not in response.content.decode()


@pytest.mark.django_db(transaction=True, databases=["default", "postgresql"])
def test_a_read_only_postgresql_session_fails_the_probe(tmp_path: Path) -> None:
    if "postgresql" not in connections:
        pytest.skip(settings.UNAVAILABLE_BACKENDS.get("db-postgresql", "no PostgreSQL"))
    entry = dict(connections["postgresql"].settings_dict)  # the migrated test database
    entry = {k: entry[k] for k in ("ENGINE", "NAME", "HOST", "PORT", "USER", "PASSWORD")}
    entry["OPTIONS"] = {"options": "-c default_transaction_read_only=on"}
    body = f"DATABASES = {{'default': {entry!r}}}\nDLOCK_BACKENDS = {{'default': {DB!r}}}\n"
    result = manage(tmp_path, body, "check")
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "no lock can be taken" in result.stdout
    assert "read-only" in result.stdout
    assert "point the backend's database at a writable primary" in result.stdout


# --- django-dlock's own names -------------------------------------------------------------


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_no_lock_can_take_or_fake_a_lag_note(name: str) -> None:
    with pytest.raises(ValueError, match="django-dlock's own"):
        lock(f"{LAG_PREFIX}forged", metadata={"watchdog_lag": {"late_s": 99}}).acquire()
    with pytest.raises(ValueError, match="django-dlock's own"):
        semaphore(f"{LAG_PREFIX}forged", limit=2).acquire()
    with pytest.raises(ValueError, match="django-dlock's own"):
        locks["default"].break_lock(f"{LAG_PREFIX}x")
    # The name the notes had before is a user's name like any other now.
    forged = {"pid": 1, "host": "h", "watchdog_lag": {"late_s": 99, "waiting": 1, "ran_out": 1}}
    with lock(f"dlock:watchdog-lagging:{name}", metadata=forged):
        out, _ = run("check")
    assert "fell behind" not in out and "warning" not in out


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
@pytest.mark.parametrize(
    "holder",
    [
        {"watchdog_lag": 5},
        {"watchdog_lag": [1, 2]},
        {"pid": {"x": 1}, "watchdog_lag": {"late_s": None}},
        {"pid": "\x1b]0;pwned\x07", "host": "\x1b[2J", "watchdog_lag": {"late_s": "\x1b[31m"}},
        {"watchdog_lag": {}},
        {"host": None, "pid": None, "watchdog_lag": {"late_s": None}},
    ],
    ids=["an-int", "a-list", "odd-types", "escapes", "empty", "nulls"],
)
def test_a_malformed_lag_note_never_crashes_the_check_nor_reaches_the_terminal(
    holder: dict[str, Any],
) -> None:
    """As someone who can write the lock service's keys directly would leave one."""
    backend = locks["default"]
    note = f"{LAG_PREFIX}{uuid.uuid4().hex}"
    owner = new_owner()
    assert backend.do_acquire(note, owner, 30, json.dumps(holder), False) is not None
    try:
        out, err = run("check")
        assert "default" in out
        assert not ESC.search(out + err), out
        if holder.get("host") is None:
            assert "a malformed watchdog lag note" in out  # not "process None on None"
        (row,) = json.loads(run("check", "--json")[0])
        assert not any("\\x" in warning for warning in row["warnings"])  # escaped once, by JSON
        listed, _ = run("--json")
        assert json.loads(listed) == []  # the notes are not anybody's locks
    finally:
        backend.do_release(note, owner)


# --- what reaches a terminal ---------------------------------------------------------------


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_show_escapes_the_metadata_keys_and_values(name: str) -> None:
    metadata = {"\x1b[2Jwipe": "\x1b]0;title\x07", "line\nbreak": "ok", "\u202eevil": 1}
    with lock(name, metadata=metadata):
        out, _ = run("show", name)
    assert not ESC.search(out), out
    assert "\u202e" not in out
    assert "holder.\\x1b[2Jwipe" in out
    assert "holder.line\\nbreak" in out


# --- guard rails --------------------------------------------------------------------------


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_an_empty_prefix_breaks_nothing_and_all_must_be_said(name: str) -> None:
    held = lock(name).acquire()
    try:
        error, out, _ = failing("break", "--prefix", "", "--yes")
        assert error.returncode == 2
        assert "--all" in str(error)
        held.ensure()
        error, _, _ = failing("break", "--all")
        assert error.returncode == 2 and "needs --yes" in str(error)
        error, _, _ = failing("break", "--all", "--prefix", "x", "--yes")
        assert error.returncode == 2
        held.ensure()
        out, _ = run("break", "--all", "--yes")
        assert f"Broke '{name}'" in out
        with pytest.raises(LockLost):
            held.ensure()
    finally:
        held.release_quietly()


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_metadata_cannot_hold_nan_and_the_listing_stays_json_when_one_does(name: str) -> None:
    for value in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(TypeError, match="JSON"):
            lock(name, metadata={"x": value})
    # A lease written by something else, straight to the lock service.
    backend, owner = locks["default"], new_owner()
    text = '{"host":"h","pid":1,"a":NaN,"b":[Infinity,-Infinity],"c":"NaN is a word"}'
    assert backend.do_acquire(name, owner, 30, text, False) is not None
    try:
        out, _ = run("--json")

        def refuse(constant: str) -> None:
            raise AssertionError(f"{constant} is not JSON")

        (row,) = json.loads(out, parse_constant=refuse)
        assert row["holder"]["a"] == "NaN"
        assert row["holder"]["b"] == ["Infinity", "-Infinity"]
        assert row["holder"]["c"] == "NaN is a word"
        shown, _ = run("show", name, "--json")
        json.loads(shown, parse_constant=refuse)
    finally:
        backend.do_release(name, owner)


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_a_watch_interval_too_long_to_sleep_is_bad_usage() -> None:
    for interval in ("1e300", "inf", "nan", "0", "-1", "soon"):
        with pytest.raises(CommandError, match="positive number of seconds"):
            run("--watch", interval)


@pytest.mark.parametrize(
    "stem",
    [
        "-leading-dash",
        "line\nfeed",
        "esc\x1b[2J",
        "quote'\\back",
        "\u202erlo",
        "c1\x9bnbsp\xa0\x85",
    ],
)
def test_the_free_one_slot_hint_works_when_pasted(
    stem: str, tmp_path: Path, redis_servers: dict[str, Any]
) -> None:
    name = f"{stem}:{uuid.uuid4().hex[:8]}"
    first = semaphore(name, limit=2, backend="redis").acquire()
    second = semaphore(name, limit=2, backend="redis").acquire()
    try:
        error, _, _ = failing("break", "--backend", "redis", "--yes", "--", name)
        assert not ESC.search(str(error)), str(error)
        (hint,) = re.findall(r"`(manage\.py locks break [^`]*)`", str(error))
        module = f"ops_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{module}.py").write_text(
            "from tests.settings import *  # noqa\n"
            "DLOCK_BACKENDS = {'default': DLOCK_BACKENDS['redis']}\n"
        )
        command = hint.replace("manage.py", f"{sys.executable} -m django", 1)
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": module,
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "testproject")]),
        }
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=ROOT,
            env=env,
            input="y\n",  # its confirmation
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, (hint, result.stderr)
        with pytest.raises(LockLost):
            first.ensure()
        second.ensure()
    finally:
        first.release_quietly()
        second.release_quietly()


def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    module = f"ops_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        f"from tests.settings import *  # noqa\nDLOCK_BACKENDS = {{'default': {LOCMEM!r}}}\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": module,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "testproject")]),
    }
    # `locks --watch 0.01 --json | head -n 1`
    result = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m django locks --watch 0.01 --json | head -n 1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout == "[]\n"
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert result.stderr == ""


def test_without_the_app_the_first_lock_says_to_install_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    apps = [a for a in settings.INSTALLED_APPS if a != "django_dlock"]
    with override_settings(INSTALLED_APPS=apps, DLOCK_BACKENDS={"default": DB}):
        with caplog.at_level(logging.DEBUG, logger="django_dlock"):
            with pytest.raises(LockConfigurationError, match="INSTALLED_APPS") as excinfo:
                lock("x").acquire(timeout=0)
    assert excinfo.value.check_id == "django_dlock.E007"
    assert "app_label" not in str(excinfo.value)
    assert not caplog.records, [r.getMessage() for r in caplog.records]


BAD = {"BACKEND": REDIS, "LOCATION": "redis://:s3cr3t-pw@127.0.0.1:99999/0"}


@override_settings(DLOCK_BACKENDS={"default": LOCMEM, "bad": BAD})
def test_a_misconfigured_backend_is_named_and_the_others_still_served(name: str) -> None:
    held = lock(name).acquire()
    try:
        error, out, err = failing()
        assert error.returncode == 2
        assert name in out  # the good backend is listed
        assert "bad: misconfigured: django_dlock.E006" in err
        error, out, err = failing("show", name)
        assert error.returncode == 2 and name in out
        error, out, err = failing("check")
        assert error.returncode == 2
        assert re.search(r"default .* ok", out) and re.search(r"bad .* FAILED", out)
        error, out, err = failing("--backend", "bad")
        assert error.returncode == 2
        error, out, err = failing("break", name, "--yes")
        assert error.returncode == 2 and f"Broke '{name}'" in out
    finally:
        held.release_quietly()
    for text in (str(error), out, err):
        assert "s3cr3t-pw" not in text


def migrated_sqlite(tmp_path: Path, *, timeout: float = 5, dlock: bool = True) -> str:
    """A settings body: a new SQLite file, migrated, as the database backend's database."""
    path = tmp_path / f"{uuid.uuid4().hex[:8]}.sqlite3"
    body = (
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', "
        f"'NAME': {str(path)!r}, 'OPTIONS': {{'timeout': {timeout!r}}}}}}}\n"
        + (f"DLOCK_BACKENDS = {{'default': {DB!r}}}\n" if dlock else "del DLOCK_BACKENDS\n")
    )
    module = f"ops_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("from tests.settings import *  # noqa\n" + body)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": module,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "testproject")]),
    }
    migrate = [sys.executable, "-m", "django", "migrate", "django_dlock", "--verbosity", "0"]
    subprocess.run(migrate, cwd=ROOT, env=env, check=True, timeout=120)
    return body


def test_locks_check_with_no_dlock_backends_setting(tmp_path: Path) -> None:
    """The zero-config default: the database backend on the "default" database."""
    body = migrated_sqlite(tmp_path, dlock=False)
    result = manage(tmp_path, body, "check")
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert re.search(
        r"default +django_dlock\.backends\.database\.DatabaseBackend .* ok", result.stdout
    )
    result = manage(tmp_path, body, "check", "--json")
    (row,) = json.loads(result.stdout)
    assert row["ok"] and row["class"].endswith("DatabaseBackend")


def test_a_database_held_busy_fails_the_probe(tmp_path: Path) -> None:
    """Another connection holds SQLite's write lock past the busy timeout: no lock can be taken."""
    import sqlite3

    body = migrated_sqlite(tmp_path, timeout=0.5)
    path = re.search(r"'NAME': '([^']+)'", body).group(1)  # type: ignore[union-attr]
    assert manage(tmp_path, body, "check").returncode == 0
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        result = manage(tmp_path, body, "check")
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "refused the probe's lease for 1 s while nobody held it" in result.stdout


@pytest.mark.django_db(transaction=True, databases=["default", "postgresql"])
def test_a_lock_table_locked_by_another_session_fails_the_probe() -> None:
    if "postgresql" not in connections:
        pytest.skip(settings.UNAVAILABLE_BACKENDS.get("db-postgresql", "no PostgreSQL"))
    import psycopg

    entry = connections["postgresql"].settings_dict
    other = psycopg.connect(
        dbname=entry["NAME"],
        host=entry["HOST"],
        port=entry["PORT"],
        user=entry["USER"],
        password=entry["PASSWORD"] or None,
    )
    try:
        other.execute("LOCK TABLE django_dlock_lease IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(BackendUnavailable, match="no lock can be taken"):
            locks["db-postgresql"].ping()
    finally:
        other.rollback()
        other.close()
    locks["db-postgresql"].ping()


@pytest.mark.parametrize(
    ("engine", "says"),
    [
        ("nosuch.engine", "cannot be loaded"),
        ("django.db.backends.dummy", "the database backend supports sqlite"),
        ("django.db.backends.sqlite3", "cannot be connected to"),  # no NAME
    ],
)
def test_a_database_engine_the_backend_cannot_use_is_named_not_a_traceback(
    engine: str, says: str, tmp_path: Path
) -> None:
    body = (
        f"DATABASES['x'] = {{'ENGINE': {engine!r}}}\n"
        f"DLOCK_BACKENDS = {{'default': {LOCMEM!r}, 'x': {{**{DB!r}, "
        "'OPTIONS': {'database': 'x'}}}\n"
    )
    for args in [(), ("check",), ("--backend", "default")]:
        result = manage(tmp_path, body, *args)
        assert "Traceback" not in result.stderr, result.stderr
        scoped = args == ("--backend", "default")  # only the good one: 0
        assert result.returncode == (0 if scoped else 2), (args, result.stdout, result.stderr)
        if not scoped:
            assert "x: misconfigured: django_dlock.E008" in result.stderr
            assert says in result.stderr


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
@pytest.mark.parametrize(
    "args",
    [
        ("show", "--", ""),
        ("show", "--", f"{INTERNAL_PREFIX}probe"),
        ("show", "--", "bad\udcffname"),  # what bash's $'\xff' gives as an argument
        ("break", "--yes", "--", ""),
        ("break", "--yes", "--", "a\x00b"),
        ("list", "--prefix", "bad\udcff"),
        ("break", "--yes", "--prefix", "a\x00"),
    ],
    ids=["empty", "internal", "surrogate", "break-empty", "nul", "prefix-surrogate", "prefix-nul"],
)
def test_a_name_no_lock_can_have_is_bad_usage_not_an_outage(args: tuple[str, ...]) -> None:
    error, _, err = failing(*args)
    assert error.returncode == 2, str(error)
    assert "did not answer" not in str(error) + err
    assert not ESC.search(str(error))


PINGER = r"""
import sys, time
import django
django.setup()
from django_dlock import locks
alias, start, count = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
locks[alias]
while time.time() < start:
    time.sleep(0.001)
failed = []
for _ in range(count):
    try:
        locks[alias].ping()
    except Exception as e:
        failed.append(f"{type(e).__name__}: {e}")
print(len(failed), failed[:1])
"""


@pytest.mark.backends("redis", "db-sqlite", "db-postgresql")
def test_probes_at_the_same_moment_do_not_fail_each_other(
    backend_alias: str, tmp_path: Path
) -> None:
    """Processes that probe one backend together meet on the probe's name: none may fail."""
    module = f"ops_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("from tests.settings import *  # noqa\n")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": module,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "testproject")]),
    }
    if backend_alias != "redis":  # the processes use the test database, as the tests do
        database = connections[settings.CONFORMANCE_BACKENDS[backend_alias]].settings_dict
        (tmp_path / f"{module}.py").write_text(
            "from tests.settings import *  # noqa\n"
            f"DATABASES[{settings.CONFORMANCE_BACKENDS[backend_alias]!r}]['NAME'] = "
            f"{database['NAME']!r}\n"
        )
    start = time.time() + 4
    pingers = [
        subprocess.Popen(
            [sys.executable, "-c", PINGER, backend_alias, str(start), "40"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120) for p in pingers]
    for out, err in outputs:
        assert out.startswith("0 "), (out, err[-2000:])


@pytest.mark.django_db(transaction=True, databases=["default", "mysql"])
def test_a_lock_table_locked_by_another_mariadb_session_is_waited_for_boundedly(
    name: str,
) -> None:
    """LOCK TABLES ... WRITE: MariaDB waits a day for a table lock unless told otherwise."""
    if "mysql" not in connections:
        pytest.skip(settings.UNAVAILABLE_BACKENDS.get("db-mysql", "no MariaDB"))
    import MySQLdb

    entry = connections["mysql"].settings_dict
    other = MySQLdb.connect(
        host=entry["HOST"],
        port=int(entry["PORT"]),
        user=entry["USER"],
        password=entry["PASSWORD"] or "",
        database=entry["NAME"],
    )
    try:
        other.cursor().execute("LOCK TABLES django_dlock_lease WRITE")
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="no lock can be taken"):
            locks["db-mysql"].ping()
        with pytest.raises(LockTimeout):
            lock(name, backend="db-mysql", timeout=2).acquire()
        assert time.monotonic() - started < 30
    finally:
        other.cursor().execute("UNLOCK TABLES")
        other.close()
    with lock(name, backend="db-mysql", timeout=5):
        pass
