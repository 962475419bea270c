"""``django_dlock.celery`` in-process: options, keys, eager mode, enqueue failures, checks.

Real workers are in test_celery_worker.py. The tasks lock on the "celery"
alias (the tests' own redis-server).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.signals import task_revoked
from django.conf import settings
from django.core import checks
from django.test import override_settings
from testproject.celery import app

from django_dlock import LockTimeout, lock, locks
from django_dlock.celery import HEADER, LockedTask, LockOptions, locked_task, park, unpark
from django_dlock.celery.parking import NoParking, park_payload
from django_dlock.signals import task_skipped
from tests import tasks
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _redis(redis_servers: Any) -> None:
    """The "celery" lock alias is the tests' own redis-server."""


@pytest.fixture
def eager() -> Iterator[None]:
    # Not task_eager_propagates: Celery's eager retry needs the Retry caught.
    saved = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = saved


@pytest.fixture
def log(tmp_path: Path) -> str:
    return str(tmp_path / "log.jsonl")


def held_names(prefix: str) -> list[str]:
    return [info.name for info in locks["celery"].list(prefix)]


# --- options -------------------------------------------------------------------------


def test_locked_task_is_a_shared_task_with_locked_task_base() -> None:
    assert isinstance(tasks.dedup, LockedTask)
    assert tasks.dedup.name == "tests.tasks.dedup"
    assert app.tasks["tests.tasks.dedup"] is tasks.dedup._get_current_object()
    options = tasks.dedup.lock_options
    assert options == LockOptions(key="dedup:{key}", ttl=30.0, backend="celery")
    # Celery options pass through.
    assert tasks.retry_once.max_retries == 3
    assert tasks.auto_retry.autoretry_for == (ValueError,)


def test_app_task_with_base_and_lock_dict() -> None:
    local = Celery("local-app", set_as_current=False)

    @local.task(base=LockedTask, lock={"key": "sync:{account_id}", "ttl": 60}, shared=False)
    def sync(account_id: int) -> int:
        return account_id

    assert sync.lock_options == LockOptions(key="sync:{account_id}", ttl=60.0)
    assert sync.lock_key((7,), {}) == "sync:7"


def test_a_task_on_a_configured_base_keeps_the_base_lock_options() -> None:
    class SyncTask(LockedTask):  # type: ignore[misc]
        lock = {"key": "sync:{account_id}", "ttl": 60, "backend": "celery"}

    local = Celery("local-base", set_as_current=False)

    @local.task(base=SyncTask, shared=False)
    def sync(account_id: int) -> int:
        return account_id

    assert sync.lock_options == LockOptions(key="sync:{account_id}", ttl=60.0, backend="celery")
    assert sync.lock_key((7,), {}) == "sync:7"


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"ttl": 0}, ValueError, "ttl"),
        ({"on_locked": "ignore"}, ValueError, "on_locked"),
        ({"scope": "worker"}, ValueError, "scope"),
        ({"scope": "queue", "on_locked": "retry"}, ValueError, "retry"),
        ({"timeout": 5}, ValueError, "on_locked='wait'"),
        ({"countdown": 5}, ValueError, "on_locked='retry'"),
        ({"on_locked": "retry", "countdown": -1}, ValueError, "countdown"),
        ({"key": ""}, TypeError, "key"),
        ({"backend": 3}, TypeError, "alias"),
        ({"lock": {"ttl": 5}, "ttl": 5}, TypeError, "twice"),
        ({"key": "x:{missing}"}, ValueError, "missing"),
        ({"limit": 0}, ValueError, "limit"),
        ({"limit": 2.5}, TypeError, "limit"),
        ({"limit": 2, "scope": "queue"}, ValueError, "scope='run'"),
        ({"on_locked": "defer", "scope": "queue"}, ValueError, "scope='run'"),
        ({"on_locked": "defer", "timeout": 3}, ValueError, "timeout"),
    ],
)
def test_bad_options_fail_where_the_task_is_defined(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):

        @locked_task(**options)
        def task(account_id: int) -> None: ...


def test_unknown_lock_option_in_a_lock_dict() -> None:
    with pytest.raises(TypeError, match="Unknown lock options"):
        LockOptions.parse({"tll": 5}, "my.task")


def test_base_must_be_a_locked_task() -> None:
    from celery import Task

    with pytest.raises(TypeError, match="LockedTask"):
        locked_task(base=Task)


def test_key_template_and_default_key() -> None:
    assert tasks.dedup.lock_key(("a", "/tmp/x"), {}) == "dedup:a"
    assert tasks.dedup.lock_key((), {"key": "a", "log": "/tmp/y"}) == "dedup:a"
    one = tasks.hashed.lock_key((7,), {})
    # Defaults apply and keyword or positional make no difference.
    assert one == tasks.hashed.lock_key((), {"account_id": 7, "full": False})
    assert one.startswith("tests.tasks.hashed:")
    assert one != tasks.hashed.lock_key((8,), {})
    assert one != tasks.hashed.lock_key((7, True), {})


def test_default_key_is_stable_across_processes() -> None:
    import subprocess
    import sys

    code = (
        "import django; django.setup(); from tests import tasks; "
        "print(tasks.hashed.lock_key((7,), {}))"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'testproject'}",
        "PYTHONHASHSEED": "123",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == tasks.hashed.lock_key((7,), {})


# --- eager mode ------------------------------------------------------------------------


@pytest.mark.usefixtures("eager")
def test_eager_run_holds_the_lock_and_exposes_the_token(log: str) -> None:
    result = tasks.dedup.delay("e1", log)
    [event] = tasks.read_log(log)
    assert result.result == event["token"]
    assert event["task_id"] == result.id
    assert held_names("dedup:e1") == []


@pytest.mark.usefixtures("eager")
def test_eager_holder_metadata_names_the_task(log: str, tmp_path: Path) -> None:
    go = tmp_path / "go"
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.append(tasks.holder.delay("m", log, str(go))))
    thread.start()
    tasks.wait_for_file(log)
    [info] = locks["celery"].list("holder:m")
    go.touch()
    thread.join()
    assert info.holder["task_name"] == "tests.tasks.holder"
    assert info.holder["task_id"] == seen[0].id
    assert info.holder["scope"] == "run"
    assert info.holder["worker"]  # the eager request's hostname
    assert info.token == seen[0].result


@pytest.mark.usefixtures("eager")
def test_eager_duplicate_is_skipped_with_a_signal(log: str, tmp_path: Path) -> None:
    go = tmp_path / "go"
    first = threading.Thread(target=tasks.dedup.delay, args=("e2", log, str(go)))
    first.start()
    tasks.wait_for_file(log)
    skipped: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        skipped.append(kwargs)

    task_skipped.connect(receiver)
    try:
        duplicate = tasks.dedup.delay("e2", log)
    finally:
        task_skipped.disconnect(receiver)
        go.touch()
        first.join()
    assert duplicate.result is None
    assert len(tasks.read_log(log)) == 1
    [signal] = skipped
    assert (signal["name"], signal["backend"], signal["scope"]) == ("dedup:e2", "celery", "run")
    assert signal["task_id"] == duplicate.id
    assert signal["template"] == "dedup:{key}"
    assert signal["sender"] is type(tasks.dedup._get_current_object())


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("how", ["ok", "fail", "ignore", "reject"])
def test_eager_lock_is_released_however_the_body_ends(how: str) -> None:
    result = tasks.outcome.delay(f"e-{how}", how)
    assert result.successful() == (how == "ok")
    assert held_names(f"outcome:e-{how}") == []


def test_direct_call_takes_the_lock_too(log: str) -> None:
    assert tasks.dedup("direct", log) == tasks.read_log(log)[0]["token"]
    assert held_names("dedup:direct") == []


@pytest.mark.usefixtures("eager")
def test_eager_on_locked_raise_and_wait(log: str, tmp_path: Path) -> None:
    go = tmp_path / "go"
    first = threading.Thread(target=tasks.raising.delay, args=("e3", log, str(go)))
    first.start()
    tasks.wait_for_file(log)
    try:
        refused = tasks.raising.delay("e3", log)
        assert refused.failed() and isinstance(refused.result, LockTimeout)
    finally:
        go.touch()
        first.join()

    go2 = tmp_path / "go2"
    log2 = str(tmp_path / "log2.jsonl")
    first = threading.Thread(target=tasks.waiting.delay, args=("e4", log2, str(go2)))
    first.start()
    tasks.wait_for_file(log2)
    threading.Timer(0.3, go2.touch).start()
    second = tasks.waiting.delay("e4", log2)  # waits for the first, then runs
    first.join()
    tokens = [event["token"] for event in tasks.read_log(log2)]
    assert len(tokens) == 2 and tokens[0] < tokens[1] == second.result


@pytest.mark.usefixtures("eager")
def test_eager_retry_is_not_a_duplicate_of_itself(log: str) -> None:
    for task in (tasks.retry_once, tasks.retry_once_queued, tasks.auto_retry):
        path = f"{log}.{task.name}"
        assert task.delay("e5", path).result == 1
        assert [event["retries"] for event in tasks.read_log(path)] == [0, 1]
    assert held_names("retry:e5") == held_names("retry-q:e5") == held_names("auto:e5") == []


@pytest.mark.usefixtures("eager")
def test_eager_queue_scope_carries_the_lease_into_the_run(log: str) -> None:
    result = tasks.dedup_queued.delay("e6", log)
    [event] = tasks.read_log(log)
    assert result.result == event["token"]
    assert held_names("dedup-q:e6") == []


# --- queue scope without a worker ------------------------------------------------------


def test_queue_lease_is_released_when_apply_async_fails() -> None:
    unreachable = Celery(
        "unreachable", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False
    )
    lock_options = {"key": "unsent:{x}", "scope": "queue", "backend": "celery"}

    @unreachable.task(base=LockedTask, lock=lock_options, shared=False)
    def send_me(x: int) -> int:
        return x

    with pytest.raises(Exception) as excinfo:  # kombu's OperationalError
        send_me.apply_async((1,), retry=False)
    assert not isinstance(excinfo.value, LockTimeout)
    assert "unsent:1" in str(excinfo.value) or held_names("unsent:1") == []
    assert held_names("unsent:1") == []


def test_queue_scope_duplicate_is_not_sent(log: str) -> None:
    # The memory transport keeps the messages in this process: nothing runs them.
    with app.connection_for_write() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        queue.clear()
        skipped: list[dict[str, Any]] = []

        def receiver(**kwargs: Any) -> None:
            skipped.append(kwargs)

        task_skipped.connect(receiver)
        try:
            results = [tasks.dedup_queued.delay(f"q{i % 2}", log) for i in range(6)]
        finally:
            task_skipped.disconnect(receiver)
        sent = results[:2]
        assert len(skipped) == 4
        # A duplicate returns the AsyncResult of the message that holds its key.
        assert [r.id for r in results] == [r.id for r in sent] * 3
        assert {s["scope"] for s in skipped} == {"queue"}
        assert queue.qsize() == 2
        messages = [queue.get(timeout=1) for _ in range(2)]
        for message, result in zip(messages, sent, strict=True):
            ticket = message.headers[HEADER]
            assert message.headers["id"] == result.id
            [info] = locks["celery"].list(ticket["name"])
            assert info.token == ticket["token"]
            assert info.holder["task_id"] == result.id
            assert info.holder["scope"] == "queue"
            locks["celery"].adopt(ticket).release()
            message.ack()
        queue.close()


def test_queue_scope_raise_and_wait_act_in_apply_async() -> None:
    """docs/celery.md: in queue scope "raise" and "wait" refuse the caller's apply_async.

    While the key is held, "raise" raises LockTimeout at once, "wait" after
    its timeout, and no message is sent; once it is free, the call is sent.
    """
    options = {"key": "refused-q:{x}", "scope": "queue", "backend": "celery"}

    @app.task(
        base=LockedTask, lock={**options, "on_locked": "raise"}, shared=False,
        name="tests.refused_q_raise",
    )  # fmt: skip
    def raising(x: int) -> int:
        return x

    @app.task(
        base=LockedTask, lock={**options, "on_locked": "wait", "timeout": 0.5}, shared=False,
        name="tests.refused_q_wait",
    )  # fmt: skip
    def waiting(x: int) -> int:
        return x

    with app.connection_for_write() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        queue.clear()
        try:
            with lock("refused-q:1", backend="celery"):
                with pytest.raises(LockTimeout):
                    raising.apply_async((1,))
                started = time.monotonic()
                with pytest.raises(LockTimeout):
                    waiting.apply_async((1,))
                assert time.monotonic() - started >= 0.4
                assert queue.qsize() == 0
            waiting.apply_async((1,))
            assert queue.qsize() == 1
            message = queue.get(timeout=1)
            locks["celery"].adopt(message.headers[HEADER]).release()
            message.ack()
        finally:
            queue.close()


# --- the visibility_timeout check ------------------------------------------------------


@pytest.fixture
def broker_options() -> Iterator[dict[str, Any]]:
    saved = app.conf.broker_url, app.conf.broker_transport_options
    options: dict[str, Any] = {}
    app.conf.broker_transport_options = options
    yield options
    app.conf.broker_url, app.conf.broker_transport_options = saved


def w002(messages: list[checks.CheckMessage]) -> dict[str, checks.CheckMessage]:
    return {str(m.obj): m for m in messages if m.id == "django_dlock.W002"}


def test_visibility_timeout_longer_than_a_lock_ttl_warns(broker_options: dict[str, Any]) -> None:
    broker_options["visibility_timeout"] = 45
    found = w002(checks.run_checks())
    # 30 s locks warn (dedup: ttl=30; hashed: the backend's default TTL, 30 s) ...
    assert "tests.tasks.dedup" in found and "tests.tasks.hashed" in found
    assert "45s" in found["tests.tasks.dedup"].msg
    # ... a 60 s one does not.
    assert "tests.tasks.later" not in found
    broker_options["visibility_timeout"] = 30
    assert w002(checks.run_checks()).keys() >= {"tests.tasks.slow"}
    assert "tests.tasks.dedup" not in w002(checks.run_checks())


def test_transport_default_visibility_timeout_applies_to_queue_scope(
    broker_options: dict[str, Any],
) -> None:
    app.conf.broker_url = "redis://127.0.0.1:1/0"  # Redis redelivers after 3600 s by default
    found = w002(checks.run_checks())
    assert {"tests.tasks.dedup_queued", "tests.tasks.later"} <= found.keys()
    assert "tests.tasks.dedup" not in found
    app.conf.broker_url = "amqp://guest@127.0.0.1//"  # no visibility timeout
    assert w002(checks.run_checks()) == {}


# --- the checks for the parts a lock backend lacks ----------------------------------------


def parts_missing(messages: list[checks.CheckMessage]) -> set[tuple[str, str]]:
    return {(m.id, str(m.obj)) for m in messages if m.id in PART_CHECKS}


PART_CHECKS = ("django_dlock.E010", "django_dlock.E011")


def on_redlock() -> Any:
    """The "celery" alias on Redlock, which has neither semaphores nor a parking queue."""
    return override_settings(
        DLOCK_BACKENDS={**settings.DLOCK_BACKENDS, "celery": settings.DLOCK_BACKENDS["redlock"]}
    )


def test_limit_and_defer_on_a_backend_without_them_are_check_errors_at_startup() -> None:
    # Only tests.tasks: other test modules define locked tasks of their own.
    assert {
        m for m in parts_missing(checks.run_checks()) if m[1].startswith("tests.tasks.")
    } == set()  # Redis has both
    with on_redlock():
        messages = [m for m in checks.run_checks() if m.id in PART_CHECKS]
    found = parts_missing(messages)
    # tests.tasks.limited and limited_one: limit=N, on_locked="defer".
    for task in ("tests.tasks.limited", "tests.tasks.limited_one"):
        assert ("django_dlock.E010", task) in found
        assert ("django_dlock.E011", task) in found
    assert all(m.is_serious() for m in messages)
    assert all("'celery'" in m.msg and "RedlockBackend" in m.msg for m in messages)
    # limited_skip: limit=N and the default on_locked ("skip"), so E010 only.
    assert ("django_dlock.E010", "tests.tasks.limited_skip") in found
    assert ("django_dlock.E011", "tests.tasks.limited_skip") not in found
    # Tasks with neither are fine there.
    ours = {task for _, task in found if task.startswith("tests.tasks.")}
    assert ours == {"tests.tasks.limited", "tests.tasks.limited_one", "tests.tasks.limited_skip"}


def test_park_and_unpark_refuse_a_backend_without_a_parking_queue() -> None:
    payload = park_payload("tests.tasks.x", [], {}, {}, 1, None)
    with on_redlock():
        with pytest.raises(NoParking, match=r"'celery'.*no parking queue") as raised:
            park("celery", "parked:x", "task-1", 1, payload)
        assert raised.value.alias == "celery"
        assert raised.value.check_id == "django_dlock.E011"
        with pytest.raises(NoParking, match="'celery'"):
            unpark("celery", "parked:x", 1)
    park("celery", "parked:x", "task-1", 1, payload)  # Redis has one
    assert [entry.key for entry in unpark("celery", "parked:x", 5)] == ["task-1"]


def test_queue_scope_run_without_a_ticket_takes_the_lock(log: str) -> None:
    # apply() (like a message sent by name) bypasses apply_async: no ticket.
    result = tasks.dedup_queued.apply(("no-ticket", log))
    [event] = tasks.read_log(log)
    assert result.result == event["token"]
    assert held_names("dedup-q:no-ticket") == []


def test_a_queue_lease_that_ran_out_is_taken_again_by_the_run(log: str) -> None:
    held = locks["celery"].acquire("dedup-q:ran-out", ttl=30, renew=False)
    ticket = held.detach()
    locks["celery"].break_lock("dedup-q:ran-out")  # as if it had run out in the queue
    result = tasks.dedup_queued.apply(("ran-out", log), headers={HEADER: ticket})
    [event] = tasks.read_log(log)
    assert result.result == event["token"] > ticket["token"]
    assert held_names("dedup-q:ran-out") == []


def test_a_queue_lease_taken_by_another_meanwhile_skips_the_run(log: str) -> None:
    held = locks["celery"].acquire("dedup-q:taken", ttl=30, renew=False)
    ticket = held.detach()
    locks["celery"].break_lock("dedup-q:taken")
    with locks["celery"].acquire("dedup-q:taken", timeout=0):
        result = tasks.dedup_queued.apply(("taken", log), headers={HEADER: ticket})
    assert result.result is None
    assert tasks.read_log(log) == []


def test_an_eager_call_cannot_be_deferred(eager: None, log: str) -> None:
    """defer parks a message for a worker: an eager call has none, so it raises."""

    @locked_task(key="eager-defer:{key}", backend="celery", on_locked="defer")
    def deferred(key: str) -> str:
        return key

    with lock("eager-defer:k", backend="celery"):
        with pytest.raises(LockTimeout, match="cannot be deferred"):
            deferred.delay("k").get(disable_sync_subtasks=False)
    assert deferred.delay("k").get(disable_sync_subtasks=False) == "k"


def test_a_parked_call_keeps_what_celerys_json_carries() -> None:
    """Arguments Celery's json serializer accepts are parked, and come back as they were.

    Found by review: plain json refused a datetime argument, so the call
    failed instead of being parked.
    """
    import datetime
    import decimal
    import uuid as uuid_module

    from kombu.utils.json import loads

    args = (
        datetime.datetime(2026, 11, 23, 12, 0),
        uuid_module.UUID(int=7),
        decimal.Decimal("1.5"),
    )
    payload = park_payload("t", args, {"when": args[0]}, {}, 1, 2)
    data = loads(payload)
    assert tuple(data["args"]) == args and data["kwargs"] == {"when": args[0]}
    with pytest.raises(TypeError, match="JSON"):
        park_payload("t", (object(),), {}, {}, 1, None)


def test_a_ticket_naming_an_unknown_backend_is_ignored(log: str) -> None:
    """A forged or stale header must not fail the task: the run takes the lock afresh."""
    held = locks["celery"].acquire("dedup-q:forged", ttl=30, renew=False)
    ticket = {**held.detach(), "backend": "nope"}
    locks["celery"].release_ticket({**ticket, "backend": "celery"})
    result = tasks.dedup_queued.apply(("forged", log), headers={HEADER: ticket})
    assert result.successful(), result.traceback
    assert len(tasks.read_log(log)) == 1
    assert held_names("dedup-q:forged") == []


# --- a ticket is adopted only on the task's own lock backend ----------------------------


def test_a_ticket_naming_another_backend_is_not_adopted(log: str) -> None:
    """Found by review: the worker adopted a ticket on whichever backend it named, so a
    forged or stale header ran the body while the task's own key was held. It is ignored as
    a foreign ticket: the run acquires on the task's backend as on_locked says (skip)."""
    name = "dedup-q:foreign"
    # A real lease of the same name on another alias: adopting it there would succeed.
    foreign = locks["locmem"].acquire(name, ttl=30, renew=False).detach()
    skipped: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        skipped.append(kwargs)

    task_skipped.connect(receiver)
    try:
        with locks["celery"].acquire(name, timeout=0):  # the task's own key is held
            result = tasks.dedup_queued.apply(("foreign", log), headers={HEADER: foreign})
        assert result.successful(), result.traceback
        assert result.result is None
        assert tasks.read_log(log) == []
        assert [(s["name"], s["backend"]) for s in skipped] == [(name, "celery")]
        # Left alone, also by a revoked message carrying it: not this task's lease.
        task_revoked.send(
            sender=tasks.dedup_queued._get_current_object(),
            request=SimpleNamespace(**{HEADER: foreign}),
            terminated=False,
        )
        assert locks["locmem"].get(name).token == foreign["token"]
        # With the key free, the run takes it on its own backend.
        result = tasks.dedup_queued.apply(("foreign", log), headers={HEADER: foreign})
        assert result.result == tasks.read_log(log)[0]["token"]
        assert held_names(name) == []
        assert locks["locmem"].get(name).token == foreign["token"]
    finally:
        task_skipped.disconnect(receiver)
        locks["locmem"].release_ticket(foreign)


# --- a naive eta ---------------------------------------------------------------------------


@pytest.mark.parametrize("zone", ["America/New_York", "Asia/Tokyo"])
def test_a_naive_eta_is_read_as_the_worker_reads_it(log: str, zone: str) -> None:
    """Celery's worker reads a naive eta in local time (TIME_ZONE; app timezone UTC): the
    queue lease covers ttl=30 plus the 120 s until then, and a duplicate is not sent.
    It was read as UTC: minutes-long waits got a lease hours short (New York) or long."""
    assert app.uses_utc_timezone()
    key = f"eta-{zone.replace('/', '-')}"
    name = f"dedup-q:{key}"
    with override_settings(TIME_ZONE=zone), app.connection_for_write() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        queue.clear()
        try:
            eta = datetime.now(ZoneInfo(zone)).replace(tzinfo=None) + timedelta(seconds=120)
            sent = tasks.dedup_queued.apply_async((key, log), eta=eta)
            [info] = locks["celery"].list(name)
            assert 120 < info.expires_in <= 150, info.expires_in
            # Not sent: the duplicate's AsyncResult is the first message's.
            assert tasks.dedup_queued.apply_async((key, log), eta=eta).id == sent.id
            assert queue.qsize() == 1
        finally:
            locks["celery"].break_lock(name)
            queue.clear()
            queue.close()


def test_a_skip_names_who_holds_the_key(log: str) -> None:
    """on_locked="skip" (the default) drops a call whose key anything else holds, a view
    for instance, and Celery records a success: task_skipped says who held it."""
    skipped: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        skipped.append(kwargs)

    task_skipped.connect(receiver)
    try:
        with locks["celery"].acquire("dedup:by-view", metadata={"view": "orders.pay"}):
            result = tasks.dedup.apply(("by-view", log))
    finally:
        task_skipped.disconnect(receiver)
    assert result.successful() and result.result is None
    assert tasks.read_log(log) == []
    [sent] = skipped
    assert sent["holder"]["view"] == "orders.pay"
    assert sent["holder"]["pid"] == os.getpid()


#: The layout of Celery's "First steps with Django": the project's package
#: imports its Celery app, which autodiscovers each installed app's tasks.
_PROJECT = {
    "proj/__init__.py": "from .celery import app as celery_app\n",
    "proj/celery.py": (
        "from celery import Celery\n"
        "app = Celery('proj')\n"
        "app.config_from_object('django.conf:settings', namespace='CELERY')\n"
        "app.autodiscover_tasks()\n"
    ),
    "proj/settings.py": (
        "SECRET_KEY = 'x'\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'django_dlock', 'shop']\n"
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3', 'NAME': ':memory:'}}\n"
        "CELERY_BROKER_URL = 'memory://'\n"
        "ROOT_URLCONF = 'shop.urls'\n"
        "DLOCK_BACKENDS = {\n"
        "    'default': {'BACKEND': 'django_dlock.backends.locmem.LocMemBackend'},\n"
        "    'redlock': {'BACKEND': 'django_dlock.backends.redis.RedlockBackend',\n"
        "                'LOCATION': ['redis://127.0.0.1:{0}', 'redis://127.0.0.1:{1}',\n"
        "                             'redis://127.0.0.1:{2}']},\n"
        "}\n"
    ),
    "shop/__init__.py": "",
    "shop/tasks.py": (
        "from django_dlock.celery import locked_task\n"
        "@locked_task(limit=2, backend='redlock')\n"
        "def limited(x): return x\n"
        "@locked_task(on_locked='defer', backend='redlock', lock={'limit': 3})\n"
        "def deferred(x): return x\n"
        "@locked_task(backend='redlok')\n"
        "def misspelt(x): return x\n"
    ),
    "shop/models.py": (
        "from django.db import models\n"
        "from django_dlock.saves import LockedSaveMixin\n"
        "class Invoice(LockedSaveMixin, models.Model):\n"
        "    lock_backend = 'defualt'\n"
    ),
    "shop/urls.py": (
        "from django.http import HttpResponse\n"
        "from django.urls import path\n"
        "from django_dlock.views import lock_view\n"
        "@lock_view('page', backend='defualt')\n"
        "def page(request): return HttpResponse()\n"
        "urlpatterns = [path('page/', page)]\n"
    ),
}


def test_the_part_checks_see_the_tasks_celery_autodiscovers(tmp_path: Path) -> None:
    """E010/E011/W005 in ``manage.py check`` for tasks only autodiscovery imports.

    Nothing imports ``shop.tasks`` but Celery's autodiscovery, which a worker
    triggers when it starts and ``manage.py check`` did not: the checks said
    "no issues" and every call failed in the worker.
    """
    import subprocess
    import sys

    ports = [free_port() for _ in range(3)]  # nothing listens: the checks make no I/O
    for path, text in _PROJECT.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text.replace("{0}", str(ports[0])).replace(
            "{1}", str(ports[1])).replace("{2}", str(ports[2])))  # fmt: skip
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "proj.settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "django", "check"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert output.count("django_dlock.E010") == 2, output  # limit=2 and lock={'limit': 3}
    assert output.count("django_dlock.E011") == 1, output
    assert "shop.tasks.limited" in output and "shop.tasks.deferred" in output
    # An alias DLOCK_BACKENDS does not have: the task's, the view's and the model's (W005).
    assert output.count("django_dlock.W005") == 3, output
    assert "shop.Invoice" in output, output
    assert "shop.tasks.misspelt" in output and "'redlok'" in output, output
    assert "shop.urls.page" in output and "'defualt'" in output, output


@pytest.mark.parametrize("alias", ["celery", "locmem"])
def test_park_and_unpark_refuse_bad_input_before_the_backend(alias: str) -> None:
    """Not BackendUnavailable (the "service down" error) nor a backend's own answer."""
    with pytest.raises(ValueError):
        park(alias, "", "task-1", 1, "{}")
    with pytest.raises(ValueError):
        park(alias, "parked:bad", "", 1, "{}")
    for order in ("x", 2**70, True):
        with pytest.raises(ValueError, match="order"):
            park(alias, "parked:bad", "task-1", order, "{}")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="payload"):
        park(alias, "parked:bad", "task-1", 1, b"{}")  # type: ignore[arg-type]
    # A payload that could never be sent again (review of issue 30: one such
    # entry took the free slot of its key on every look).
    for payload in ("not json", "{}", "[]", '{"task": "t", "args": {}, "kwargs": {}}'):
        with pytest.raises(ValueError, match="payload"):
            park(alias, "parked:bad", "task-1", 1, payload)
    # A key every backend can store: no NUL, at most 255 characters.
    good = '{"task": "t", "args": [], "kwargs": {}}'
    for key in ("task\x00-1", "k" * 256):
        with pytest.raises(ValueError, match="key"):
            park(alias, "parked:bad", key, 1, good)
    for count in (-1, 0, "3"):
        with pytest.raises(ValueError, match="count"):
            unpark(alias, "parked:bad", count)  # type: ignore[arg-type]
    assert unpark(alias, "parked:bad", 5) == []


@pytest.mark.usefixtures("eager")
def test_a_lease_broken_while_the_task_runs_is_one_warning_and_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator breaks a running task's lock: the loss is logged when it is found, the task
    says once that it ended unprotected, and nothing is logged as an ERROR or with a traceback.
    The body's result stands (failing a task whose work is done could retry it)."""
    caplog.set_level(logging.INFO, logger="django_dlock")
    result = tasks.broken_midway.delay("by-operator")
    assert result.successful() and result.result == "done"
    ours = [r for r in caplog.records if r.name.startswith("django_dlock")]
    assert [r for r in ours if r.levelno >= logging.ERROR or r.exc_info] == []
    [lost] = [r for r in ours if r.name == "django_dlock" and r.levelno == logging.WARNING]
    assert "'broken:by-operator'" in lost.getMessage() and "was lost" in lost.getMessage()
    [ended] = [r for r in ours if r.name == "django_dlock.celery" and r.levelno >= logging.WARNING]
    assert result.id in ended.getMessage()
    assert "was not protected by the lock" in ended.getMessage()
    assert held_names("broken:by-operator") == []


def test_the_default_key_of_an_aware_datetime_survives_the_message() -> None:
    """kombu's json brings an aware datetime back with a fixed-offset tzinfo: its repr is not
    the caller's ZoneInfo one, so the worker computed another key, and in queue scope the run
    ignored its ticket and the lease stayed held until its TTL."""
    from kombu.utils.json import dumps, loads

    sent = datetime(2026, 11, 28, 9, 30, tzinfo=ZoneInfo("Asia/Tokyo"))
    arrived = loads(dumps({"args": [sent]}))["args"][0]
    assert arrived == sent and repr(arrived) != repr(sent)
    assert tasks.hashed.lock_key((arrived,)) == tasks.hashed.lock_key((sent,))
    assert tasks.hashed.lock_key((sent,)) != tasks.hashed.lock_key((sent + timedelta(hours=1),))
    # One instant, one key, in whatever zone it was written (now() and localtime()).
    in_utc = sent.astimezone(ZoneInfo("UTC"))
    assert tasks.hashed.lock_key((in_utc,)) == tasks.hashed.lock_key((sent,))


def test_w002_is_registered_with_the_app_not_by_the_adapter() -> None:
    """In Celery's Django layout the tasks modules, and so django_dlock.celery, are first
    imported while the checks run: a check the adapter registered then never ran."""
    from django.core.checks.registry import registry

    from django_dlock import celery as adapter

    registered = {(c.__module__, c.__name__) for c in registry.get_checks()}
    assert ("django_dlock.checks", "check_visibility_timeouts") in registered
    assert ("django_dlock.celery", adapter.check_visibility_timeout.__name__) not in registered
