"""``django_dlock.task_framework``: locked tasks of Django's task framework.

On ImmediateBackend (the task runs inside ``enqueue()``): options, errors,
keys, each ``on_locked`` and each scope. On django-tasks-db's DatabaseBackend
with real ``db_worker`` processes: duplicates over two keys run two bodies.
The framework is Django 6's ``django.tasks`` or, before Django 6, the
django-tasks package; without either these tests are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.core import checks
from django.db import transaction
from django.test import override_settings

from django_dlock import LockTimeout, lock, locks, semaphore
from django_dlock.signals import lock_acquired, task_skipped

try:
    import django_dlock.task_framework  # noqa: F401
except ImportError:
    pytest.skip(
        "Django's task framework is not installed: Django 6+ or the django-tasks package",
        allow_module_level=True,
    )

from django_dlock.task_framework import (
    TICKET_KWARG,
    LockedTask,
    current_lock,
    locked_task,
)
from tests import framework_tasks as ft
from tests.tasks import read_log

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def log(tmp_path: Path) -> str:
    return str(tmp_path / "log.jsonl")


@pytest.fixture
def key() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def skipped() -> Iterator[list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        sent.append(kwargs)

    task_skipped.connect(receiver)
    yield sent
    task_skipped.disconnect(receiver)


def status(result: Any) -> str:
    return str(result.status)


# --- definition ---------------------------------------------------------------------------


def test_django_6_uses_its_own_framework_and_older_django_the_package() -> None:
    import django

    module = "django.tasks.base" if django.VERSION >= (6,) else "django_tasks.base"
    assert LockedTask.__mro__[1].__module__ == module


def test_without_a_framework_the_import_error_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "for name in ('django.tasks', 'django_tasks'): sys.modules[name] = None\n"
        "import django_dlock.task_framework\n"
        "from django_dlock.task_framework import locked_task\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1
    assert "ImportError: django_dlock.task_framework needs Django's task framework" in done.stderr
    assert "django-dlock[tasks]" in done.stderr


def test_celery_autodiscovery_imports_no_module_of_ours() -> None:
    """Celery imports every installed app's ``tasks`` module: django_dlock has none to import."""
    code = (
        "import importlib.util, sys\n"
        "import django\n"
        "django.setup()\n"
        "from testproject.celery import app\n"
        "app.autodiscover_tasks(force=True)\n"
        "assert importlib.util.find_spec('django_dlock.tasks') is None\n"
        "print([m for m in sys.modules if m.startswith('django_dlock')"
        " and m.endswith('.tasks')])\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "testproject")]),
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n"


def test_limit_on_a_backend_without_semaphores_is_a_check_error_at_startup() -> None:
    """tests.framework_tasks.limited has limit=2 on "locmem"; on Redlock that cannot run."""
    assert [m for m in checks.run_checks() if m.id == "django_dlock.E010"] == []
    redlock = {**settings.DLOCK_BACKENDS, "locmem": settings.DLOCK_BACKENDS["redlock"]}
    with override_settings(DLOCK_BACKENDS=redlock):
        found = [m for m in checks.run_checks() if m.id == "django_dlock.E010"]
    [message] = [m for m in found if m.obj == "tests.framework_tasks.limited"]
    assert message.is_serious()
    assert "limit=2" in message.msg and "'locmem'" in message.msg and "semaphores" in message.msg


def test_a_task_on_an_alias_dlock_backends_lacks_is_a_check_warning() -> None:
    """W005: review of issue 30 (a typo passed the checks, and every call failed)."""
    assert [m for m in checks.run_checks() if m.id == "django_dlock.W005"] == []
    without = {k: v for k, v in settings.DLOCK_BACKENDS.items() if k != "locmem"}
    with override_settings(DLOCK_BACKENDS=without):
        found = [m for m in checks.run_checks() if m.id == "django_dlock.W005"]
    [message] = [m for m in found if m.obj == "tests.framework_tasks.limited"]
    assert not message.is_serious()  # a warning: see checks._backend_of
    assert "'locmem'" in message.msg and "DLOCK_BACKENDS" in message.msg


@pytest.mark.django_db
def test_bare_decorator_makes_a_locked_task_on_the_default_lock_backend() -> None:
    assert isinstance(ft.bare, LockedTask)
    assert ft.bare.lock_options.backend == "default"
    assert (ft.bare.lock_options.scope, ft.bare.lock_options.on_locked) == ("run", "skip")
    result = ft.bare.enqueue(1, b=5)
    assert status(result) == "SUCCESSFUL"
    assert result.return_value == 6


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"colour": "red"}, TypeError, "Unknown options"),
        ({"on_locked": "defer"}, ValueError, "Celery-only"),
        ({"on_locked": "retry"}, ValueError, "Celery-only.*no retry"),
        ({"on_locked": "sometimes"}, ValueError, "on_locked of .* must be one of"),
        ({"scope": "enqueue"}, ValueError, "scope of .* must be one of"),
        ({"timeout": 5}, ValueError, "timeout applies to on_locked='wait' only"),
        ({"scope": "queue", "limit": 2}, ValueError, "limit applies to scope='run' only"),
        ({"limit": 0}, ValueError, "limit"),
        ({"ttl": -1}, ValueError, "ttl|TTL"),
        ({"key": "x:{nope}"}, ValueError, r"names \['nope'\]"),
        ({"key": "x:{}"}, ValueError, "must name arguments"),
        ({"backend": 3}, TypeError, "alias"),
    ],
)
def test_bad_options_fail_where_the_task_is_defined(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    def body(a: int) -> int:
        return a

    with pytest.raises(error, match=match):
        locked_task(**options)(body)


def test_lock_options_may_come_as_a_dict_as_with_celery() -> None:
    task = locked_task(lock={"key": "d:{a}", "backend": "locmem", "ttl": 5})(ft.bare.func)
    assert (task.lock_options.key, task.lock_options.backend) == ("d:{a}", "locmem")
    assert task.lock_options.ttl == 5
    with pytest.raises(TypeError, match="'key' is given twice"):
        locked_task(lock={"key": "d:{a}"}, key="e:{a}")(ft.bare.func)
    with pytest.raises(TypeError, match="must be a dict"):
        locked_task(lock="d:{a}")(ft.bare.func)


def test_positional_options_are_refused() -> None:
    with pytest.raises(TypeError, match="keyword options only"):
        locked_task("key:{a}")  # type: ignore[arg-type]


def test_task_options_pass_through_and_task_backend_names_the_tasks_alias() -> None:
    task = locked_task(key="p:{a}", backend="locmem", priority=5, queue_name="default")(
        ft.bare.func
    )
    assert (task.priority, task.queue_name, task.backend) == (5, "default", "default")
    assert task.lock_options.backend == "locmem"
    with pytest.raises(Exception, match="nope"):
        locked_task(task_backend="nope")(ft.bare.func)


def test_a_backend_with_its_own_task_class_is_refused() -> None:
    tasks = {**settings.TASKS, "other": {"BACKEND": "tests.framework_tasks.OtherTaskBackend"}}
    with override_settings(TASKS=tasks):
        with pytest.raises(TypeError, match="makes OtherTask tasks"):
            locked_task(task_backend="other")(ft.bare.func)


def test_using_keeps_the_lock_options() -> None:
    again = ft.queued.using(priority=3)
    assert isinstance(again, LockedTask)
    assert again.lock_options == ft.queued.lock_options
    assert again.lock_key(("k", "log")) == "queue:k"


def test_default_key_hashes_all_arguments() -> None:
    one = ft.default_key.lock_key((1,), {"b": 2})
    assert one == ft.default_key.lock_key((), {"a": 1, "b": 2})
    assert one != ft.default_key.lock_key((1,), {"b": 3})
    assert one.startswith("tests.framework_tasks.default_key:")


# --- run scope ----------------------------------------------------------------------------


def test_body_runs_under_its_lock_and_releases_it(key: str, log: str) -> None:
    result = ft.skipping.enqueue(key, log)
    assert status(result) == "SUCCESSFUL"
    [event] = read_log(log)
    assert event["name"] == f"skip:{key}"
    assert result.return_value == event["token"]
    assert locks["locmem"].get(f"skip:{key}") is None
    assert current_lock() is None


def test_skip_does_not_run_the_body_and_sends_task_skipped(
    key: str, log: str, skipped: list[dict[str, Any]]
) -> None:
    with locks["locmem"].acquire(f"skip:{key}"):
        result = ft.skipping.enqueue(key, log)
    assert status(result) == "SUCCESSFUL"
    assert result.return_value is None
    assert read_log(log) == []
    [sent] = skipped
    assert sent["sender"] is LockedTask
    assert sent["task"] is result.task or sent["task"].func is ft.skipping.func
    assert (sent["name"], sent["backend"], sent["scope"]) == (f"skip:{key}", "locmem", "run")
    assert sent["task_id"] == result.id
    assert (list(sent["args"]), sent["kwargs"]) == ([key, log], {})


def test_raise_fails_the_run_with_lock_timeout(key: str, log: str) -> None:
    with locks["locmem"].acquire(f"raise:{key}"):
        result = ft.raising.enqueue(key, log)
    assert status(result) == "FAILED"
    assert result.errors[0].exception_class is LockTimeout
    assert read_log(log) == []


def test_wait_runs_the_body_once_the_lock_is_free(key: str, log: str) -> None:
    held = locks["locmem"].acquire(f"wait:{key}")
    timer = threading.Timer(0.3, held.release)
    timer.start()
    try:
        started = time.monotonic()
        result = ft.waiting.enqueue(key, log)
    finally:
        timer.join()
    assert status(result) == "SUCCESSFUL"
    assert time.monotonic() - started >= 0.25
    assert len(read_log(log)) == 1


def test_limit_runs_up_to_limit_bodies_per_key(key: str, log: str) -> None:
    name = f"limit:{key}"
    with semaphore(name, limit=2, backend="locmem"):
        assert ft.limited.enqueue(key, log).return_value is not None  # the second slot
        with semaphore(name, limit=2, backend="locmem"):
            assert ft.limited.enqueue(key, log).return_value is None  # both taken: skipped
    assert len(read_log(log)) == 1


def test_context_is_not_part_of_the_key_and_gives_the_task_id(key: str, log: str) -> None:
    result = ft.with_context.enqueue(key, log)
    assert status(result) == "SUCCESSFUL"
    assert result.return_value == result.id
    assert read_log(log)[0]["name"] == f"ctx:{key}"


def test_acquisitions_carry_their_key_template(key: str, log: str) -> None:
    seen: list[Any] = []

    def receiver(held: Any, **kwargs: Any) -> None:
        seen.append(held.template)

    lock_acquired.connect(receiver)
    try:
        ft.skipping.enqueue(key, log)
    finally:
        lock_acquired.disconnect(receiver)
    assert seen == ["skip:{key}"]


# --- queue scope --------------------------------------------------------------------------


def test_queue_scope_skips_a_duplicate_enqueue(
    key: str, log: str, skipped: list[dict[str, Any]]
) -> None:
    with locks["locmem"].acquire(f"queue:{key}"):
        assert ft.queued.enqueue(key, log) is None
    assert read_log(log) == []
    [sent] = skipped
    assert (sent["name"], sent["scope"], sent["task_id"]) == (f"queue:{key}", "queue", None)


def test_queue_scope_hands_the_enqueue_lease_to_the_run(key: str, log: str) -> None:
    tokens: list[int] = []

    def receiver(sender: Any, name: str, token: int, **kwargs: Any) -> None:
        if name == f"queue:{key}":
            tokens.append(token)

    lock_acquired.connect(receiver)
    try:
        result = ft.queued.enqueue(key, log)
    finally:
        lock_acquired.disconnect(receiver)
    assert status(result) == "SUCCESSFUL"
    # Taken in enqueue() and adopted by the run: one token, no second acquisition.
    assert tokens and set(tokens) == {result.return_value}
    assert TICKET_KWARG in result.kwargs
    assert locks["locmem"].get(f"queue:{key}") is None


def test_a_ticket_that_ran_out_is_acquired_afresh(key: str, log: str) -> None:
    name = f"queue:{key}"
    stale = locks["locmem"].acquire(name, renew=False)
    ticket = stale.detach()
    locks["locmem"].break_lock(name)
    token = ft.queued.call(key, log, **{TICKET_KWARG: ticket})
    assert token > stale.token
    assert locks["locmem"].get(name) is None


@pytest.mark.django_db
def test_the_queue_lease_covers_the_wait_until_run_after(key: str, log: str) -> None:
    if "db" not in getattr(settings, "TASKS", {}):
        pytest.skip("django-tasks-db is not installed (ImmediateBackend has no run_after)")
    later = datetime.now(timezone.utc) + timedelta(seconds=120)
    result = ft.queued.using(backend="db", run_after=later).enqueue(key, log)
    assert result is not None  # enqueued, not run: no worker here
    lease = locks["locmem"].get(f"queue:{key}")
    assert lease is not None
    assert 120 < lease.expires_in <= 130  # ttl=10 plus the wait
    assert ft.queued.enqueue(key, log) is None  # a duplicate meanwhile is skipped
    locks["locmem"].break_lock(f"queue:{key}")


@pytest.mark.django_db
def test_a_queue_lease_whose_task_never_runs_runs_out(key: str, log: str) -> None:
    if "db" not in getattr(settings, "TASKS", {}):
        pytest.skip("django-tasks-db is not installed (ImmediateBackend runs every task)")
    task = ft.queued_briefly.using(backend="db")  # no worker: it never runs
    assert task.enqueue(key, log) is not None
    assert task.enqueue(key, log) is None
    deadline = time.monotonic() + 5
    while locks["locmem"].get(f"short:{key}") is not None:  # not renewed: ttl=1
        assert time.monotonic() < deadline, "the queue lease was renewed"
        time.sleep(0.1)
    assert task.enqueue(key, log) is not None  # so a duplicate can be enqueued then
    locks["locmem"].break_lock(f"short:{key}")


def test_queue_scope_keys_the_arguments_as_the_worker_gets_them(log: str) -> None:
    """A tuple arrives as a list (JSON): the run must still find its own ticket."""
    key = ("t", uuid.uuid4().hex[:8])
    result = ft.queued.enqueue(key, log)
    assert status(result) == "SUCCESSFUL"
    assert result.return_value is not None
    [event] = read_log(log)
    assert event["name"] == f"queue:{list(key)}"
    assert locks["locmem"].get(f"queue:{list(key)}") is None


def test_a_ticket_for_another_key_is_left_alone(key: str, log: str) -> None:
    """A ticket copied from another call's result must not end that call's lease."""
    other = locks["locmem"].acquire(f"queue:{key}-other", renew=False).detach()
    token = ft.queued.call(key, log, **{TICKET_KWARG: other})
    assert token is not None
    assert read_log(log)[0]["name"] == f"queue:{key}"
    assert locks["locmem"].get(f"queue:{key}-other").token == other["token"]
    locks["locmem"].release_ticket(other)


def test_a_run_scope_call_neither_takes_nor_releases_a_ticket(key: str, log: str) -> None:
    """The queue lease of a queued call, handed to a run-scope task: enqueue refuses it,
    and a direct call leaves it to its owner."""
    queued = ft.queued.using(backend="dummy").enqueue(key, log)
    ticket = queued.kwargs[TICKET_KWARG]
    with pytest.raises(TypeError, match="reserved"):
        ft.skipping.enqueue(key, log, **{TICKET_KWARG: ticket})
    with pytest.raises(TypeError, match="reserved"):
        asyncio.run(ft.skipping.aenqueue(key, log, **{TICKET_KWARG: ticket}))
    assert ft.skipping.call(key, log, **{TICKET_KWARG: ticket}) is not None
    assert locks["locmem"].get(f"queue:{key}").token == ticket["token"]
    assert ft.queued.using(backend="dummy").enqueue(key, log) is None  # still deduplicated
    locks["locmem"].release_ticket(ticket)


def test_a_forged_ticket_naming_no_backend_is_ignored(key: str, log: str) -> None:
    forged = {**locks["locmem"].acquire(f"queue:{key}", renew=False).detach(), "backend": "nope"}
    locks["locmem"].break_lock(f"queue:{key}")
    assert ft.queued.call(key, log, **{TICKET_KWARG: forged}) is not None
    assert len(read_log(log)) == 1


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_enqueue_gives_its_queue_lease_back(key: str, log: str) -> None:
    """The task's row is rolled back: so is the lease, or retries would be skipped."""
    if "db" not in settings.TASKS:
        pytest.skip("django-tasks-db is not installed")
    task = ft.queued.using(backend="db")  # ttl 10 s; no worker: it never runs

    class Rollback(Exception):
        pass

    with pytest.raises(Rollback):
        with transaction.atomic():
            assert task.enqueue(key, log) is not None
            raise Rollback
    deadline = time.monotonic() + 3
    while locks["locmem"].get(f"queue:{key}") is not None:
        assert time.monotonic() < deadline, "the lease outlived the rolled-back task"
        time.sleep(0.01)
    with transaction.atomic():
        committed = task.enqueue(key, log)
    assert committed is not None
    assert task.enqueue(key, log) is None  # a committed enqueue keeps its lease
    locks["locmem"].break_lock(f"queue:{key}")


@pytest.mark.django_db(transaction=True)
def test_a_committed_enqueue_keeps_its_lease_behind_a_failing_on_commit_hook(
    key: str, log: str
) -> None:
    """Issue 27 review, the sibling of the release: Django stops at the first failing
    hook, and the rollback marker queued behind it, freed uncalled later, gave the
    committed task's queue lease back: a duplicate could be enqueued."""
    if "db" not in settings.TASKS:
        pytest.skip("django-tasks-db is not installed")
    task = ft.queued.using(backend="db")  # ttl 10 s; no worker: it never runs

    def send_mail() -> None:
        raise RuntimeError("the mail server is down")

    with pytest.raises(RuntimeError, match="mail server"):
        with transaction.atomic():
            transaction.on_commit(send_mail)
            assert task.enqueue(key, log) is not None
    gc.collect()  # the exception and its frames are gone: nothing is left to call back
    time.sleep(0.3)  # a release handed to another thread would be done by now
    assert locks["locmem"].get(f"queue:{key}") is not None
    assert task.enqueue(key, log) is None  # still a duplicate
    locks["locmem"].break_lock(f"queue:{key}")


def test_holder_metadata_names_the_task_the_run_and_the_worker(key: str, log: str) -> None:
    seen: list[dict[str, Any]] = []

    def receiver(held: Any, **kwargs: Any) -> None:
        seen.append(dict(held.holder))

    lock_acquired.connect(receiver)
    try:
        result = ft.skipping.enqueue(key, log)
    finally:
        lock_acquired.disconnect(receiver)
    [holder] = seen
    assert holder["task_id"] == result.id
    assert holder["task_name"] == "tests.framework_tasks.skipping"
    assert holder["worker"] == result.worker_ids[-1]
    assert holder["scope"] == "run"


def test_the_ticket_kwarg_is_reserved(key: str, log: str) -> None:
    with pytest.raises(TypeError, match="reserved"):
        ft.queued.enqueue(key, log, **{TICKET_KWARG: {}})


def test_enqueue_failure_releases_the_queue_lease(key: str, log: str) -> None:
    framework = settings.TASKS["default"]["BACKEND"]
    with override_settings(TASKS={"default": {"BACKEND": framework, "QUEUES": ["other"]}}):
        with pytest.raises(Exception, match="not valid"):
            ft.queued.enqueue(key, log)
    assert locks["locmem"].get(f"queue:{key}") is None


def test_acalls_of_different_keys_run_at_once(log: str) -> None:
    """Three async bodies each wait until all three have started: serialized, they could not."""

    async def three() -> list[Any]:
        keys_ = [f"k{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
        return await asyncio.wait_for(
            asyncio.gather(*(ft.rendezvous.acall(k, log, 3) for k in keys_)), 20
        )

    tokens = asyncio.run(three())
    assert all(t is not None for t in tokens)
    assert len(read_log(log)) == 3


def test_an_acall_cancelled_while_it_waits_leaves_no_lease(key: str, log: str) -> None:
    """The waiting thread gets the lease after the cancel: it must be released, not kept."""
    blocker = locks["locmem"].acquire(f"wait:{key}")

    async def cancel_while_waiting() -> None:
        call = asyncio.ensure_future(ft.waiting.acall(key, log))
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        blocker.release()  # the thread's wait now ends with the lease

    asyncio.run(cancel_while_waiting())
    deadline = time.monotonic() + 5
    while locks["locmem"].get(f"wait:{key}") is not None:
        assert time.monotonic() < deadline, "the cancelled call's lease was kept"
        time.sleep(0.01)
    assert read_log(log) == []


def test_an_acall_that_waits_uses_no_thread_of_the_default_executor(key: str, log: str) -> None:
    """Issue 27 #5: its wait took a thread of the loop's default executor, as releases did."""
    from concurrent.futures import ThreadPoolExecutor

    class NoDefaultExecutor(ThreadPoolExecutor):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("acall() used the event loop's default executor")

    blocker = locks["locmem"].acquire(f"wait:{key}")

    async def wait_then_run() -> Any:
        asyncio.get_running_loop().set_default_executor(NoDefaultExecutor(1))
        call = asyncio.ensure_future(ft.waiting.acall(key, log))
        await asyncio.sleep(0.2)
        blocker.release()
        return await asyncio.wait_for(call, 20)

    assert asyncio.run(wait_then_run()) is not None
    assert len(read_log(log)) == 1


def test_acall_locks_like_call(key: str, log: str) -> None:
    token = async_to_sync(ft.skipping.acall)(key, log)
    assert read_log(log)[0]["token"] == token
    assert locks["locmem"].get(f"skip:{key}") is None


def test_async_enqueue_and_task(key: str, log: str) -> None:
    result = async_to_sync(ft.asynchronous.aenqueue)(key, log)
    assert status(result) == "SUCCESSFUL"
    assert async_to_sync(ft.asynchronous.aenqueue)(key, log) is not None  # released
    assert len(read_log(log)) == 2


# --- real workers: django-tasks-db's db_worker --------------------------------------------


DUPLICATES, KEYS = 10, 2


class DBWorker:
    """``django-admin db_worker`` on the test database, in its own process group."""

    def __init__(self, tmp: Path, index: int) -> None:
        self.log = tmp / f"worker-{index}.log"
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.tasks_worker_settings",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "testproject")]),
        }
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "django", "db_worker", "--backend", "db",
                    "--interval", "0.1", "--no-startup-delay", "--no-reload",
                    "--worker-id", f"dlock-test-{index}", "-v", "2",
                ],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=20)


@pytest.fixture
def db_workers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[DBWorker]]:
    if "db" not in getattr(settings, "TASKS", {}):
        pytest.skip("django-tasks-db is not installed (its DatabaseBackend runs the workers)")
    workers = [DBWorker(tmp_path, i) for i in range(request.param)]
    yield workers
    for worker in workers:
        worker.kill()


def eventually(predicate: Callable[[], bool], limit: float, what: str, logs: Any = ()) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(w.log.read_text()[-3000:] for w in logs)
            raise AssertionError(f"not within {limit}s: {what}\n{tails}")
        time.sleep(0.1)


def finished(results: list[Any]) -> int:
    done = 0
    for result in results:
        result.refresh()
        done += result.is_finished
    return done


@pytest.mark.multiprocess
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("db_workers", [1], indirect=True)
def test_queue_scope_on_a_real_worker_runs_two_bodies_for_ten_enqueues(
    db_workers: list[DBWorker], log: str, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:6]
    go = str(tmp_path / "go")
    keys_ = [f"{run}-{i % KEYS}" for i in range(DUPLICATES)]
    task = ft.dedup_queued.using(backend="db")
    sent = [task.enqueue(k, log, go) for k in keys_]
    enqueued = [r for r in sent if r is not None]
    assert len(enqueued) == KEYS
    go_time = time.monotonic()
    Path(go).touch()
    eventually(lambda: finished(enqueued) == KEYS, 60, "both runs finished", db_workers)
    assert all(status(r) == "SUCCESSFUL" for r in enqueued), [r.errors for r in enqueued]
    events = read_log(log)
    assert sorted(e["key"] for e in events) == sorted(set(keys_))
    assert {e["pid"] for e in events} == {db_workers[0].process.pid}
    assert sorted(r.return_value for r in enqueued) == sorted(e["token"] for e in events)
    assert locks["db-sqlite"].list(f"dedup-q:{run}") == []
    assert time.monotonic() - go_time < 60


@pytest.mark.multiprocess
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("db_workers", [3], indirect=True)
def test_run_scope_on_real_workers_runs_two_bodies_for_ten_enqueues(
    db_workers: list[DBWorker], log: str, tmp_path: Path
) -> None:
    """Three workers: two hold the first call of each key until ``go``; the third skips 8."""
    run = uuid.uuid4().hex[:6]
    go = str(tmp_path / "go")
    keys_ = [f"{run}-{i % KEYS}" for i in range(DUPLICATES)]
    task = ft.dedup.using(backend="db")
    results = [task.enqueue(k, log, go) for k in keys_]
    eventually(lambda: finished(results) == DUPLICATES - KEYS, 90, "8 skipped runs", db_workers)
    assert len(read_log(log)) == KEYS  # both first bodies are still running
    Path(go).touch()
    eventually(lambda: finished(results) == DUPLICATES, 60, "all runs finished", db_workers)
    assert all(status(r) == "SUCCESSFUL" for r in results), [r.errors for r in results]
    events = read_log(log)
    assert sorted(e["key"] for e in events) == sorted(set(keys_))
    assert sorted(r.return_value for r in results if r.return_value is not None) == sorted(
        e["token"] for e in events
    )
    workers = {w.process.pid for w in db_workers}
    assert len({e["pid"] for e in events} & workers) == KEYS  # two worker processes ran them
    assert locks["db-sqlite"].list(f"dedup:{run}") == []


# --- metrics ------------------------------------------------------------------------------


def test_runs_and_skips_are_counted_under_the_key_template(key: str, log: str) -> None:
    prometheus = pytest.importorskip(
        "django_dlock.contrib.prometheus", reason="prometheus_client is not installed"
    )
    from prometheus_client import CollectorRegistry

    metrics = prometheus.install(registry=CollectorRegistry())
    get = metrics.registry.get_sample_value
    labels = {"backend": "locmem", "pattern": "skip:{key}"}
    try:
        assert status(ft.skipping.enqueue(key, log)) == "SUCCESSFUL"
        with lock(f"skip:{key}", backend="locmem"):
            assert status(ft.skipping.enqueue(key, log)) == "SUCCESSFUL"
        assert get("dlock_acquisitions_total", labels) == 1
        assert get("dlock_tasks_skipped_total", {**labels, "scope": "run"}) == 1
    finally:
        prometheus.uninstall()
    assert len(read_log(log)) == 1


# --- run_after in the project's time zone ------------------------------------------------

ZONES = ("America/New_York", "Asia/Tokyo")


def _task_backends() -> list[Any]:
    """DummyBackend keeps what is enqueued; django-tasks-db stores it (no worker runs it)."""
    marks = [pytest.mark.django_db]
    if "db" not in getattr(settings, "TASKS", {}):
        marks.append(pytest.mark.skip(reason="django-tasks-db is not installed"))
    return ["dummy", pytest.param("db", marks=marks)]


def _assert_lease_covers_the_wait(key: str, log: str, task: Any) -> None:
    """ttl=10 plus the 120 s until run_after; a duplicate meanwhile is skipped."""
    assert task.enqueue(key, log) is not None  # enqueued, not run: no worker here
    lease = locks["locmem"].get(f"queue:{key}")
    try:
        assert lease is not None
        assert 120 < lease.expires_in <= 130, lease.expires_in
        assert task.enqueue(key, log) is None  # a duplicate meanwhile is skipped
        assert ft.queued.enqueue(key, log) is None
    finally:
        locks["locmem"].break_lock(f"queue:{key}")
    assert read_log(log) == []


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("task_backend", _task_backends())
def test_a_naive_run_after_is_read_in_time_zone_without_use_tz(
    key: str, log: str, zone: str, task_backend: str
) -> None:
    """USE_TZ=False: run_after is local time in TIME_ZONE, as the task backends read it.

    Found by review: it was read as UTC, so in New York the lease lasted 2 s
    (a duplicate could be enqueued meanwhile) and in Tokyo 9 hours.
    """
    from zoneinfo import ZoneInfo

    from django.utils import timezone as dj_timezone

    with override_settings(USE_TZ=False, TIME_ZONE=zone):
        now = datetime.now(ZoneInfo(zone)).replace(tzinfo=None)  # wall-clock time there
        assert abs((dj_timezone.now() - now).total_seconds()) < 60  # what the backends compare
        later = now + timedelta(seconds=120)
        task = ft.queued.using(backend=task_backend, run_after=later)
        _assert_lease_covers_the_wait(key, log, task)


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("task_backend", _task_backends())
def test_run_after_in_a_time_zone_with_use_tz(
    key: str, log: str, zone: str, task_backend: str
) -> None:
    """USE_TZ=True: an aware run_after in any zone counts; a naive one is refused by the
    framework before any lease is taken."""
    from django.utils import timezone as dj_timezone

    with override_settings(USE_TZ=True, TIME_ZONE=zone):
        later = dj_timezone.localtime() + timedelta(seconds=120)
        assert str(later.tzinfo) == zone
        _assert_lease_covers_the_wait(
            key, log, ft.queued.using(backend=task_backend, run_after=later)
        )
        # InvalidTaskError (django-tasks) or InvalidTask (Django 6): the name differs.
        with pytest.raises(Exception, match="run_after must be an aware datetime"):
            ft.queued.using(backend=task_backend, run_after=later.replace(tzinfo=None))
        assert locks["locmem"].get(f"queue:{key}") is None


@pytest.mark.parametrize("zone", ZONES)
def test_a_naive_run_after_follows_an_activated_time_zone(zone: str) -> None:
    """The current time zone, as Django reads naive datetimes: activate() overrides TIME_ZONE."""
    from django.utils import timezone as dj_timezone

    from django_dlock.task_framework import _delay

    with override_settings(USE_TZ=False, TIME_ZONE="UTC"), dj_timezone.override(zone):
        local = datetime.now(dj_timezone.get_current_timezone()).replace(tzinfo=None)
        assert 110 < _delay(local + timedelta(seconds=120)) <= 120


# --- a ticket is adopted only on the task's own lock backend ------------------------------


def test_a_ticket_naming_another_backend_is_not_adopted(
    key: str, log: str, skipped: list[dict[str, Any]]
) -> None:
    """Found by review: a ticket was adopted on whichever backend it named, so a forged or
    stale one ran the body while the task's own key was held. It is ignored as a foreign
    ticket: the run acquires on the task's backend as on_locked says (skip here)."""
    name = f"queue:{key}"
    # A real lease of the same name on another alias: adopting it there would succeed.
    foreign = locks["example"].acquire(name, ttl=30, renew=False).detach()
    try:
        with locks["locmem"].acquire(name, ttl=30):  # the task's own key is held
            assert ft.queued.call(key, log, **{TICKET_KWARG: foreign}) is None
            assert async_to_sync(ft.queued.acall)(key, log, **{TICKET_KWARG: foreign}) is None
        assert read_log(log) == []
        assert [s["backend"] for s in skipped] == ["locmem", "locmem"]
        # Left alone: it is not this task's lease to take up or end.
        assert locks["example"].get(name).token == foreign["token"]
        # With the key free, the run takes it on its own backend, not the foreign lease.
        token = ft.queued.call(key, log, **{TICKET_KWARG: foreign})
        assert [e["name"] for e in read_log(log)] == [name]
        assert locks["locmem"].get(name) is None
        assert token is not None
        assert locks["example"].get(name).token == foreign["token"]
    finally:
        locks["example"].release_ticket(foreign)


# --- a key held by a view: the default skip ------------------------------------------------


def test_a_skip_because_a_view_holds_the_key_names_the_view(
    key: str, log: str, skipped: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """With on_locked="skip" (the default) a call whose key anything else holds, here a
    guarded view, is dropped and its result is SUCCESSFUL: task_skipped and the log line
    say who held it (docs/django-tasks.md, "Skipped is not failed")."""
    from django.http import HttpResponse
    from django.test import RequestFactory

    from django_dlock.views import lock_view

    @lock_view("skip:{key}", backend="locmem", metadata={"view": "orders.pay"})
    def pay(request: Any, key: str) -> HttpResponse:
        result = ft.skipping.enqueue(key, log)  # ImmediateBackend: runs here, skipped
        return HttpResponse(f"{status(result)} {result.return_value}")

    with caplog.at_level("INFO", logger="django_dlock.task_framework"):
        response = pay(RequestFactory().post("/"), key=key)
    assert response.content == b"SUCCESSFUL None"  # dropped, and recorded as a success
    assert read_log(log) == []
    [sent] = skipped
    assert sent["name"] == f"skip:{key}"
    assert sent["holder"]["view"] == "orders.pay"
    assert sent["holder"]["pid"] == os.getpid()
    assert any(
        "is held by" in r.getMessage() and "orders.pay" in r.getMessage() for r in caplog.records
    )
    # A semaphore's slots have no one holder to name.
    with semaphore(f"limit:{key}", limit=2, backend="locmem"):
        with semaphore(f"limit:{key}", limit=2, backend="locmem"):
            assert ft.limited.enqueue(key, log).return_value is None
    assert skipped[-1]["holder"] is None
