"""``manage.py locks``: in-process through ``call_command``, and as a real process
(exit codes, the confirmation prompt, ``--watch``)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_dlock import Lock, LockLost, LockTimeout, lock, locks, rwlock, semaphore
from django_dlock.backends.base import BaseLockBackend
from django_dlock.celery.parking import park_payload
from django_dlock.signals import lock_broken
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
LOCMEM = {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}
TASK = {"task_name": "billing.tasks.sync_account", "task_id": "5f0c1a2e-task", "note": "nightly"}


def run(*args: str) -> str:
    out = StringIO()
    call_command("locks", *args, stdout=out, stderr=StringIO(), no_color=True)
    return out.getvalue()


def cells(line: str) -> list[str]:
    """A table line's cells: columns are two or more spaces apart."""
    return re.split(r" {2,}", line.strip())


def failing(*args: str) -> tuple[CommandError, str]:
    out = StringIO()
    with pytest.raises(CommandError) as excinfo:
        call_command("locks", *args, stdout=out, stderr=StringIO(), no_color=True)
    return excinfo.value, out.getvalue()


# --- every backend -----------------------------------------------------------------------


def test_list_json_show_break_and_check_on_every_backend(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    with lock(name, backend=backend_alias, metadata=TASK) as held:
        table = run("--backend", backend_alias, "--prefix", name)
        header, row = map(cells, table.splitlines())
        assert header == ["BACKEND", "NAME", "TOKEN", "HOLDER", "HELD FOR", "EXPIRES IN"]
        host, pid = held.holder["host"], os.getpid()
        assert row[:4] == [
            backend_alias,
            name,
            str(held.token),
            f"{host}:{pid} billing.tasks.sync_account[5f0c1a2e-task]",
        ]
        assert row[4].endswith("s") and row[5].endswith("s")

        (item,) = json.loads(run("list", "--backend", backend_alias, "--prefix", name, "--json"))
        assert item["backend"] == backend_alias
        assert item["name"] == name
        assert item["token"] == held.token
        assert item["holder"]["task_id"] == "5f0c1a2e-task"
        assert item["holder"]["pid"] == pid
        assert 0 < item["expires_in"] <= 30
        assert item["held_for"] >= 0

        shown = run("show", name, "--backend", backend_alias)
        assert f"token               {held.token}" in shown
        assert "holder.note         nightly" in shown
        assert "holder.task_name    billing.tasks.sync_account" in shown

        broke = run("break", name, "--backend", backend_alias, "--yes")
        assert f"Broke '{name}' on {backend_alias} (token {held.token}" in broke
        with pytest.raises(LockLost):
            held.ensure()
        assert backend.list(name) == []
        with pytest.raises(LockLost):
            held.release()

    checked = run("check", "--backend", backend_alias)
    assert cells(checked.splitlines()[1])[:2] == [backend_alias, backend.path]
    assert checked.rstrip().endswith("ok") or "warning" in checked


# --- list ----------------------------------------------------------------------------------


@override_settings(DLOCK_BACKENDS={"default": LOCMEM, "other": {**LOCMEM, "KEY_PREFIX": "o"}})
def test_list_covers_every_backend_and_filters(name: str) -> None:
    with (
        lock(f"{name}:a"),
        lock(f"{name}:b", backend="other"),
        lock("unrelated", backend="other"),
    ):
        names = [line.split()[:2] for line in run("--prefix", name).splitlines()[1:]]
        assert names == [["default", f"{name}:a"], ["other", f"{name}:b"]]
        only = [line.split()[1] for line in run("--backend", "other").splitlines()[1:]]
        assert only == [f"{name}:b", "unrelated"]
    assert run("--prefix", name) == f"No locks held with names starting {name!r}.\n"


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_json_with_nothing_held_is_an_empty_list() -> None:
    assert json.loads(run("--json", "--prefix", "nothing-here")) == []


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_control_characters_in_names_and_metadata_are_escaped(name: str) -> None:
    evil = f"{name}\x1b[2J\x07\n"
    with lock(evil, metadata={"note": "\x1b]0;pwned\x07"}):
        table = run("--prefix", name)
        shown = run("show", evil)
        listed = run("--prefix", name, "--json")
    for output in (table, shown, listed):
        assert "\x1b" not in output and "\x07" not in output
    assert f"{name}\\x1b[2J\\x07\\n" in table
    assert "holder.note" in shown and "\\x1b]0;pwned\\x07" in shown
    assert json.loads(listed)[0]["name"] == evil


def test_a_backend_that_does_not_answer_is_reported_and_the_rest_listed(name: str) -> None:
    down = {"BACKEND": "django_dlock.backends.redis.RedisBackend"}
    down["LOCATION"] = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    with override_settings(DLOCK_BACKENDS={"default": LOCMEM, "down": down}), lock(name):
        out, err = StringIO(), StringIO()
        with pytest.raises(CommandError) as excinfo:
            call_command("locks", "--prefix", name, stdout=out, stderr=err, no_color=True)
        assert excinfo.value.returncode == 3
        assert "down" in str(excinfo.value)
        assert err.getvalue().startswith("down: Redis at redis://:***@127.0.0.1:")
        assert "hunter2" not in err.getvalue()
        lines = out.getvalue().splitlines()
        assert cells(lines[1])[:2] == ["default", name]

        error, output = failing("check")
        assert error.returncode == 3
        assert "hunter2" not in output
        rows = {line.split()[0]: line for line in output.splitlines()[1:] if line[:1] != " "}
        assert rows["default"].endswith("ok")
        assert rows["down"].endswith("FAILED")


# --- show and break ------------------------------------------------------------------------


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_show_and_break_of_a_lock_nobody_holds_exit_1(name: str) -> None:
    error, _ = failing("show", name)
    assert error.returncode == 1
    assert str(error) == f"{name!r} is not held."
    error, _ = failing("break", name, "--yes")
    assert error.returncode == 1
    error, _ = failing("break", "--prefix", name, "--yes")
    assert error.returncode == 1


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
@pytest.mark.parametrize(
    "args",
    [("break",), ("break", "x", "--prefix", "x", "--yes"), ("break", "--prefix", "x")],
    ids=["nothing", "both", "prefix-without-yes"],
)
def test_break_usage_errors_exit_2_and_break_nothing(name: str, args: tuple[str, ...]) -> None:
    with lock("x") as held:
        error, _ = failing(*args)
        held.ensure()
    assert error.returncode == 2


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_break_by_prefix_breaks_only_those_names(name: str) -> None:
    broken: list[tuple[str, int | None]] = []

    def on_broken(sender: Any, **kwargs: Any) -> None:
        broken.append((kwargs["name"], kwargs["token"]))

    a, b = lock(f"{name}:a").acquire(), lock(f"{name}:b").acquire()
    with lock(f"other:{name}") as other:
        lock_broken.connect(on_broken)
        try:
            output = run("break", "--prefix", f"{name}:", "--yes")
        finally:
            lock_broken.disconnect(on_broken)
        other.ensure()
    for held in (a, b):
        with pytest.raises(LockLost):
            held.ensure()
        assert f"Broke '{held.name}' on default (token {held.token}" in output
    assert sorted(broken) == sorted([(a.name, a.token), (b.name, b.token)])


# --- semaphores and read/write locks -------------------------------------------------------

SLOT_HEADER = [
    "BACKEND",
    "NAME",
    "KIND",
    "LIMIT",
    "MODE",
    "TOKEN",
    "HOLDER",
    "HELD FOR",
    "EXPIRES IN",
    "WAITING",
    "PARKED",
]


@contextlib.contextmanager
def waiter(side: Lock, backend: BaseLockBackend) -> Iterator[None]:
    """A thread that waits for ``side`` (recorded by the backend as waiting),
    takes it once the test releases what blocks it, and lets it go."""
    name = side.name
    before = sum(info.waiting for info in backend.semaphores(name) if info.name == name)
    thread = threading.Thread(target=lambda: side.acquire(timeout=30).release())
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while (
            sum(info.waiting for info in backend.semaphores(name) if info.name == name) == before
        ):
            assert time.monotonic() < deadline, "the waiter was never recorded"
            time.sleep(0.01)
        yield
    finally:
        thread.join(timeout=30)


@contextlib.contextmanager
def parked_call(key: str) -> Iterator[None]:
    """A Celery call parked on ``key`` in the default backend, as ``on_locked="defer"``
    parks it (the backend's own queue), and unparked at the end."""
    payload = park_payload("billing.tasks.call_api", [1], {}, {}, 1, 2)
    locks["default"].do_park(key, "task-1", 1, payload)
    try:
        yield
    finally:
        locks["default"].do_unpark(key, 10)


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_semaphores_and_rwlocks_follow_the_mutexes_in_a_table_of_their_own(
    name: str, request: pytest.FixtureRequest
) -> None:
    backend = locks["default"]
    mutex = lock(f"{name}:mutex").acquire()  # released when the test ends, whatever happens
    request.addfinalizer(mutex.release_quietly)
    host = mutex.holder["host"]
    exports = [semaphore(f"{name}:exports", limit=3).acquire() for _ in range(2)]
    reader = rwlock(f"{name}:catalog").read().acquire()
    with parked_call(f"{name}:api"), waiter(rwlock(f"{name}:catalog").write(), backend):
        table = run("--prefix", name).splitlines()
        listed = json.loads(run("--prefix", name, "--json"))
        reader.release()
    for held in exports:
        held.release()

    # The mutexes' table is what it always was; a blank line; then the slots.
    assert cells(table[0]) == ["BACKEND", "NAME", "TOKEN", "HOLDER", "HELD FOR", "EXPIRES IN"]
    assert cells(table[1])[1] == f"{name}:mutex"
    assert table[2] == ""
    assert cells(table[3]) == SLOT_HEADER
    rows = [cells(line) for line in table[4:]]
    me = f"{host}:{os.getpid()}"
    assert [row[:7] + row[9:] for row in rows] == [
        ["default", f"{name}:api", "semaphore", "-", "-", "-", "-", "0", "1"],
        ["default", f"{name}:catalog", "rwlock", "-", "read", str(reader.token), me, "1", "0"],
        *(
            ["default", f"{name}:exports", "semaphore", "3", "slot", str(h.token), me, "0", "0"]
            for h in exports
        ),
    ]
    assert rows[0][7:9] == ["-", "-"]
    assert all(row[7].endswith("s") and row[8].endswith("s") for row in rows[1:])

    # JSON: one object per row; the mutex's keys as before, plus "kind" on every one.
    mutex, api, catalog, *slots = listed
    lease_keys = {"backend", "name", "token", "holder", "acquired_at", "expires_at"}
    lease_keys |= {"expires_in", "held_for"}
    assert set(mutex) == lease_keys | {"kind"} and mutex["kind"] == "mutex"
    for item in (api, catalog, *slots):
        assert set(item) == lease_keys | {"kind", "limit", "mode", "waiting", "parked"}
    assert (api["kind"], api["limit"], api["mode"], api["token"], api["holder"]) == (
        "semaphore",
        None,
        None,
        None,
        None,
    )
    assert (api["waiting"], api["parked"]) == (0, 1)
    assert (catalog["kind"], catalog["limit"], catalog["mode"]) == ("rwlock", None, "read")
    assert (catalog["token"], catalog["waiting"], catalog["holder"]["pid"]) == (
        reader.token,
        1,
        os.getpid(),
    )
    assert [(s["kind"], s["limit"], s["mode"], s["token"]) for s in slots] == [
        ("semaphore", 3, "slot", h.token) for h in exports
    ]
    assert 0 < slots[0]["expires_in"] <= 30 and slots[0]["held_for"] >= 0


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_only_semaphores_held_prints_only_their_table(name: str) -> None:
    with semaphore(name, limit=2) as held:
        header, row = map(cells, run("--prefix", name).splitlines())
    assert header == SLOT_HEADER
    assert row[:6] == ["default", name, "semaphore", "2", "slot", str(held.token)]


@override_settings(
    DLOCK_BACKENDS={
        "default": LOCMEM,
        "example": {
            "BACKEND": "tests.example_backend.SQLiteFileBackend",
            "LOCATION": ":memory:",
        },
    }
)
def test_a_backend_without_semaphores_is_listed_without_them(name: str) -> None:
    assert not locks["example"].supports_semaphores
    with semaphore(name, limit=2), lock(name, backend="example") as mutex:
        table = run("--prefix", name).splitlines()
        shown = run("show", name)
    assert cells(table[1])[:3] == ["example", name, str(mutex.token)]
    assert cells(table[4])[:3] == ["default", name, "semaphore"]
    assert (
        "kind                semaphore" in shown and f"token               {mutex.token}" in shown
    )


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_show_a_semaphore_holder_and_a_waiting_writer(name: str) -> None:
    readers = [rwlock(name, metadata={"note": "nightly"}).read().acquire() for _ in range(2)]
    with waiter(rwlock(name).write(), locks["default"]):
        shown = run("show", name)
        (first, *_) = json.loads(run("show", name, "--json"))
        for held in readers:
            held.release()
    blocks = [block for block in shown.split("\n\n") if block.strip()]
    assert len(blocks) == 2
    for block, held in zip(blocks, readers, strict=True):
        fields = dict(cells(line) for line in block.splitlines())
        assert fields["kind"] == "rwlock" and fields["limit"] == "-"
        assert (fields["mode"], fields["waiting"], fields["parked"]) == ("read", "1", "0")
        assert fields["token"] == str(held.token) and fields["holder.note"] == "nightly"
    assert (first["kind"], first["mode"], first["token"]) == ("rwlock", "read", readers[0].token)


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_break_frees_the_one_slot_chosen_by_token(name: str) -> None:
    broken: list[tuple[str, int | None]] = []

    def on_broken(sender: Any, **kwargs: Any) -> None:
        broken.append((kwargs["name"], kwargs["token"]))

    first, second, third = (semaphore(name, limit=3).acquire() for _ in range(3))
    try:
        # Without a token: refused, with the tokens to choose from, and nothing freed.
        error, _ = failing("break", name, "--yes")
        assert error.returncode == 2
        assert f"semaphore '{name}' has 3 holder(s)" in str(error)
        assert str(first.token) in str(error) and "--all-slots" in str(error)
        assert f"manage.py locks break --token {first.token} -- {shlex.quote(name)}" in str(error)
        for held in (first, second, third):
            held.ensure()

        lock_broken.connect(on_broken)
        try:
            output = run("break", name, "--token", str(second.token), "--yes")
        finally:
            lock_broken.disconnect(on_broken)
        assert output == (
            f"Freed the slot of semaphore '{name}' on default (token {second.token}, "
            f"held by {second.holder['host']}:{os.getpid()}).\n"
        )
        assert broken == [(name, second.token)]
        with pytest.raises(LockLost):
            second.ensure()
        first.ensure()
        third.ensure()
        (info,) = locks["default"].semaphores(name)
        assert [h.token for h in info.holders] == [first.token, third.token]
        # The freed slot is free: a newcomer enters at once.
        with semaphore(name, limit=3, timeout=0) as newcomer:
            assert newcomer.token > third.token

        # The same token again: nothing left to free.
        error, _ = failing("break", name, "--token", str(second.token), "--yes")
        assert error.returncode == 1
        assert (
            str(error)
            == f"Nothing broken: {name!r} has no lease or slot with token {second.token}."
        )
    finally:
        for held in (first, third):
            held.release()
        with contextlib.suppress(LockLost):
            second.release()


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_break_a_writer_of_a_rwlock_lets_the_readers_in(name: str) -> None:
    writer = rwlock(name).write().acquire()
    with pytest.raises(LockTimeout):
        rwlock(name, timeout=0).read().acquire()
    output = run("break", name, "--token", str(writer.token), "--yes")
    assert (
        f"Freed the write slot of read/write lock '{name}' on default (token {writer.token}"
        in output
    )
    with pytest.raises(LockLost):
        writer.ensure()
    with rwlock(name, timeout=0).read() as reader:
        assert reader.token > writer.token


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_a_mutex_with_a_token_is_broken_only_if_it_has_that_token(name: str) -> None:
    held = lock(name).acquire()
    error, _ = failing("break", name, "--token", str(held.token - 1), "--yes")
    assert error.returncode == 1
    held.ensure()
    output = run("break", name, "--token", str(held.token), "--yes")
    assert f"Broke '{name}' on default (token {held.token}" in output
    with pytest.raises(LockLost):
        held.ensure()


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_break_by_prefix_leaves_slots_unless_all_slots(name: str) -> None:
    mutex = lock(f"{name}:m").acquire()
    slots = [semaphore(f"{name}:s", limit=2).acquire() for _ in range(2)]
    reader = rwlock(f"{name}:rw").read().acquire()
    output = run("break", "--prefix", name, "--yes")
    assert f"Broke '{name}:m' on default (token {mutex.token}" in output
    assert "Left alone: 2 semaphores and read/write locks have 3 holders" in output
    with pytest.raises(LockLost):
        mutex.ensure()
    for held in (*slots, reader):
        held.ensure()

    # Only slots under the prefix, no --all-slots: refused, nothing freed.
    error, _ = failing("break", "--prefix", name, "--yes")
    assert error.returncode == 2 and "--all-slots" in str(error)
    reader.ensure()

    output = run("break", "--prefix", name, "--yes", "--all-slots")
    for held in (*slots, reader):
        assert f"'{held.name}' on default (token {held.token}" in output
        with pytest.raises(LockLost):
            held.ensure()
    assert locks["default"].semaphores(name) == []


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_all_slots_frees_every_slot_of_a_name(name: str) -> None:
    slots = [semaphore(name, limit=5).acquire() for _ in range(3)]
    output = run("break", name, "--all-slots", "--yes")
    assert output.count(f"Freed the slot of semaphore '{name}'") == 3
    for held in slots:
        with pytest.raises(LockLost):
            held.ensure()


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
def test_the_confirmation_lists_the_slot_and_no_breaks_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = iter(["n", "y"])
    monkeypatch.setattr("builtins.input", lambda question: next(answers))
    held = semaphore(name, limit=2).acquire()
    error, out = failing("break", name, "--token", str(held.token))
    assert error.returncode == 1
    lines = out.splitlines()
    assert lines[0] == "About to break:"
    assert cells(lines[1]) == SLOT_HEADER
    assert cells(lines[2])[:6] == ["default", name, "semaphore", "2", "slot", str(held.token)]
    held.ensure()
    assert "Freed the slot" in run("break", name, "--token", str(held.token))
    with pytest.raises(LockLost):
        held.ensure()


@override_settings(DLOCK_BACKENDS={"default": LOCMEM})
@pytest.mark.parametrize(
    "args",
    [
        ("break", "--prefix", "x", "--token", "1", "--yes"),
        ("break", "x", "--token", "1", "--all-slots", "--yes"),
    ],
    ids=["token-with-prefix", "token-with-all-slots"],
)
def test_slot_break_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    with semaphore("x", limit=1) as held:
        error, _ = failing(*args)
        held.ensure()
    assert error.returncode == 2


def test_list_and_break_a_slot_on_every_backend(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    if not backend.supports_semaphores:
        pytest.skip(f"backend {backend_alias!r} declares no supports_semaphores")
    held = [semaphore(name, limit=2, backend=backend_alias).acquire() for _ in range(2)]
    writer = rwlock(f"{name}:rw", backend=backend_alias).write().acquire()
    try:
        header, *rows = map(cells, run("--backend", backend_alias, "--prefix", name).splitlines())
        assert header == SLOT_HEADER
        assert [row[:6] for row in rows] == [
            [backend_alias, name, "semaphore", "2", "slot", str(held[0].token)],
            [backend_alias, name, "semaphore", "2", "slot", str(held[1].token)],
            [backend_alias, f"{name}:rw", "rwlock", "-", "write", str(writer.token)],
        ]
        listed = json.loads(run("--backend", backend_alias, "--prefix", name, "--json"))
        assert [(i["kind"], i["mode"], i["token"]) for i in listed] == [
            ("semaphore", "slot", held[0].token),
            ("semaphore", "slot", held[1].token),
            ("rwlock", "write", writer.token),
        ]
        output = run(
            "break", name, "--backend", backend_alias, "--token", str(held[1].token), "--yes"
        )
        assert f"Freed the slot of semaphore '{name}' on {backend_alias}" in output
        with pytest.raises(LockLost):
            held[1].ensure()
        held[0].ensure()
        writer.ensure()
    finally:
        for h in (held[0], writer):
            h.release()
        with contextlib.suppress(LockLost):
            held[1].release()


# --- as a real process ---------------------------------------------------------------------


def manage(
    settings_module: str, *args: str, input: str | None = None, extra_path: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "django", "locks", *args],
        cwd=ROOT,
        env=_env(settings_module, extra_path),
        input=input,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _env(settings_module: str, extra_path: str = "") -> dict[str, str]:
    path = os.pathsep.join(p for p in (extra_path, str(ROOT), str(ROOT / "testproject")) if p)
    return {**os.environ, "DJANGO_SETTINGS_MODULE": settings_module, "PYTHONPATH": path}


@pytest.fixture
def redis_only(tmp_path: Path, redis_servers: dict[str, Any]) -> str:
    """A settings module whose only lock backend is the test Redis, named "default"."""
    (tmp_path / "redis_only_settings.py").write_text(
        "from tests.settings import *  # noqa\n"
        "DLOCK_BACKENDS = {'default': DLOCK_BACKENDS['redis']}\n"
    )
    return str(tmp_path)


def test_confirmation_prompt(redis_only: str, name: str) -> None:
    held = lock(name, backend="redis").acquire()
    try:
        for answer in ("n\n", "", "maybe\n"):
            result = manage(
                "redis_only_settings", "break", name, input=answer, extra_path=redis_only
            )
            assert result.returncode == 1, result.stderr
            assert "About to break:" in result.stdout
            assert cells(result.stdout.splitlines()[2])[1:3] == [name, str(held.token)]
            assert "Break these leases? Their holders will lose them. [y/N]" in result.stdout
            assert "Nothing broken." in result.stderr
            held.ensure()
        result = manage("redis_only_settings", "break", name, input="y\n", extra_path=redis_only)
        assert result.returncode == 0, result.stderr
        assert f"Broke '{name}' on default (token {held.token}" in result.stdout
        with pytest.raises(LockLost):
            held.ensure()
    finally:
        locks["redis"].break_lock(name, token=held.token)


def test_exit_codes_of_the_process(redis_only: str, tmp_path: Path, name: str) -> None:
    result = manage("redis_only_settings", "show", name, extra_path=redis_only)
    assert result.returncode == 1
    assert result.stderr.endswith(f"CommandError: {name!r} is not held.\n")
    result = manage("redis_only_settings", "break", "--prefix", name, extra_path=redis_only)
    assert result.returncode == 2
    assert "Breaking by --prefix needs --yes" in result.stderr
    result = manage("redis_only_settings", "--backend", "nope", extra_path=redis_only)
    assert result.returncode == 2
    assert "invalid choice: 'nope'" in result.stderr
    result = manage("redis_only_settings", "--watch", "0", extra_path=redis_only)
    assert result.returncode == 2
    assert "must be a positive number of seconds" in result.stderr
    result = manage("redis_only_settings", "check", extra_path=redis_only)
    assert result.returncode == 0, result.stderr
    assert "Redis " in result.stdout

    (tmp_path / "down_settings.py").write_text(
        "from tests.settings import *  # noqa\n"
        "DLOCK_BACKENDS = {'default': {'BACKEND': 'django_dlock.backends.redis.RedisBackend',"
        f" 'LOCATION': 'redis://127.0.0.1:{free_port()}/0'}}}}\n"
    )
    result = manage("down_settings", "check", extra_path=str(tmp_path))
    assert result.returncode == 3
    assert "FAILED" in result.stdout
    result = manage("down_settings", "list", extra_path=str(tmp_path))
    assert result.returncode == 3


def _interruptible() -> None:
    """In the child: Ctrl-C raises KeyboardInterrupt even if our runner ignores SIGINT.

    A shell's background job starts with SIGINT ignored, and Python keeps an
    ignored SIGINT ignored: the interrupt the test sends would do nothing.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _watch(redis_only: str, *args: str) -> list[str]:
    """Run ``locks --watch`` until it has printed some output, interrupt it, return its lines."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "django", "locks", *args],
        cwd=ROOT,
        env=_env("redis_only_settings", redis_only),
        preexec_fn=_interruptible,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if sum("Every " in ln or ln.startswith("[") for ln in lines) >= 3:
                break
        proc.send_signal(signal.SIGINT)
        # Not communicate(): it would skip what readline() has buffered.
        rest, err = proc.stdout.read(), proc.stderr.read() if proc.stderr else ""
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return lines + rest.splitlines(keepends=True)


def test_watch_refreshes_until_interrupted(redis_only: str, name: str) -> None:
    with lock(name, backend="redis") as held:
        lines = _watch(redis_only, "--watch", "0.2", "--prefix", name)
    frames = [ln for ln in lines if ln.startswith("Every 0.2s: locks list")]
    assert len(frames) >= 3
    rows = [ln for ln in lines if cells(ln)[:3] == ["default", name, str(held.token)]]
    assert len(rows) >= 3
    assert "\x1b[2J" not in "".join(lines)  # not a terminal: frames follow each other


def test_watch_json_prints_one_document_per_refresh(redis_only: str, name: str) -> None:
    with lock(name, backend="redis") as held:
        lines = _watch(redis_only, "list", "--json", "--watch", "0.2", "--prefix", name)
    documents = [json.loads(ln) for ln in lines if ln.strip()]
    assert len(documents) >= 3
    assert all([item["token"] for item in doc] == [held.token] for doc in documents)


def test_watch_on_a_terminal_redraws_in_place(redis_only: str, name: str) -> None:
    primary, secondary = pty.openpty()
    with lock(name, backend="redis"):
        proc = subprocess.Popen(
            [sys.executable, "-m", "django", "locks", "--watch", "0.2", "--prefix", name],
            cwd=ROOT,
            env=_env("redis_only_settings", redis_only),
            preexec_fn=_interruptible,
            stdout=secondary,
            stderr=subprocess.PIPE,
        )
        os.close(secondary)
        output = b""
        try:
            deadline = time.monotonic() + 30
            while output.count(b"\x1b[H\x1b[2J") < 3 and time.monotonic() < deadline:
                output += os.read(primary, 65536)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
            os.close(primary)
    # Each refresh homes the cursor and clears the screen before the new frame.
    frames = output.split(b"\x1b[H\x1b[2J")[1:]
    assert len(frames) >= 3
    assert all(frame.startswith(b"Every 0.2s: locks list") for frame in frames)


@override_settings(
    DLOCK_BACKENDS={
        "default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend", "OPTIONS": {"x": 1}}
    }
)
def test_misconfigured_backends_are_reported_not_a_traceback() -> None:
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError) as excinfo:
        call_command("locks", "list", stdout=out, stderr=err, no_color=True)
    assert excinfo.value.returncode == 2
    assert "misconfigured" in str(excinfo.value)
    assert err.getvalue().startswith("default: misconfigured: django_dlock.E004: ")


@override_settings(DLOCK_BACKENDS=["not", "a", "dict"])
def test_a_setting_that_is_not_a_dict_is_reported() -> None:
    error, _ = failing("check")
    assert error.returncode == 2
    assert "django_dlock.E001" in str(error)
