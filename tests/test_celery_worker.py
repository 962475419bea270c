"""``@locked_task`` on real prefork workers, on a Redis broker and on RabbitMQ.

The workers are ``celery -A testproject worker`` processes with 6 pool
processes; the test process sends the messages and reads the results (on the
tests' own redis-server) and the lock list. Bodies record each run in a log
file, so the counts below are bodies that really ran.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.backends.redis import RedisBackend
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult
from django.conf import settings
from testproject.celery import app

from django_dlock import locks
from tests import tasks
from tests.servers import CeleryWorker, port_open

pytestmark = pytest.mark.multiprocess

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
DUPLICATES, KEYS = 20, 4


class Worker:
    """A running worker, and how the test process talks to its broker."""

    def __init__(self, process: CeleryWorker, broker: str, results: str) -> None:
        self.process = process
        self.broker = broker
        self.queue = process.queue
        self.backend = RedisBackend(app=app, url=results)
        # Remote control through an app of the worker's broker: app.control
        # would publish through the test app's own (in-memory) producer pool.
        self.control_app = Celery("control", broker=broker, set_as_current=False)

    def send(self, task: Any, *args: Any, queue: str | None = None, **options: Any) -> Any:
        with app.connection_for_write(self.broker) as conn, conn.Producer() as producer:
            return task.apply_async(args, producer=producer, queue=queue or self.queue, **options)

    def result(self, sent: Any) -> AsyncResult:
        return AsyncResult(sent.id, backend=self.backend, app=app)

    def get(self, sent: Any, timeout: float = 60) -> Any:
        return self.result(sent).get(timeout=timeout, disable_sync_subtasks=False)

    def control(self, method: str, **kwargs: Any) -> Any:
        replies = getattr(self.control_app.control, method)(
            destination=[self.process.nodename], reply=True, timeout=10, **kwargs
        )
        assert replies, f"{self.process.nodename} did not answer {method}"
        return replies

    def queue_size(self, queue: str) -> int:
        with app.connection_for_write(self.broker) as conn:
            simple = conn.SimpleQueue(queue)
            try:
                return int(simple.qsize())
            finally:
                simple.close()


def start_worker(name: str, broker: str) -> tuple[CeleryWorker, str]:
    port = settings.REDIS_PORTS["single"]
    results = f"redis://127.0.0.1:{port}/2"
    queue = f"dlock-{name}-{uuid.uuid4().hex[:8]}"
    return CeleryWorker(name, broker, results, queue).start(), results


@pytest.fixture(scope="module")
def redis_worker(redis_servers: Any) -> Iterator[Worker]:
    broker = f"redis://127.0.0.1:{settings.REDIS_PORTS['single']}/1"
    process, results = start_worker("redis-broker", broker)
    yield Worker(process, broker, results)
    process.cleanup()


@pytest.fixture(scope="module")
def rabbitmq_worker(redis_servers: Any) -> Iterator[Worker]:
    if not port_open("127.0.0.1", 5672):
        if settings.REQUIRE_ALL:
            pytest.fail("DLOCK_REQUIRE_ALL_BACKENDS=1 but RabbitMQ is not on 127.0.0.1:5672")
        pytest.skip("RabbitMQ is not reachable on 127.0.0.1:5672")
    process, results = start_worker("rabbitmq-broker", RABBITMQ)
    yield Worker(process, RABBITMQ, results)
    process.cleanup()


@pytest.fixture(params=["redis", "rabbitmq"])
def worker(request: pytest.FixtureRequest) -> Worker:
    return request.getfixturevalue(f"{request.param}_worker")  # type: ignore[no-any-return]


@pytest.fixture
def log(tmp_path: Path) -> str:
    return str(tmp_path / "log.jsonl")


def held(prefix: str) -> list[Any]:
    return locks["celery"].list(prefix)


def eventually(predicate: Callable[[], bool], limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {limit}s: {what}")
        time.sleep(0.05)


# --- duplicates --------------------------------------------------------------------------


def test_duplicates_run_once_per_key_in_run_scope(
    worker: Worker, log: str, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    run = uuid.uuid4().hex[:6]
    keys = [f"{run}-{i % KEYS}" for i in range(DUPLICATES)]
    sent = [worker.send(tasks.dedup, key, log, str(go)) for key in keys]
    # The first body of each key holds its lock until `go`; the other 16
    # calls are processed meanwhile and skipped.
    results = [worker.result(s) for s in sent]
    eventually(
        lambda: sum(r.ready() for r in results) == DUPLICATES - KEYS, 60, "16 skipped calls"
    )
    # A skipped message did not run: it is recorded as REVOKED, not as a success.
    skipped = [r for r in results if r.ready()]
    assert {r.state for r in skipped} == {"REVOKED"}
    for r in skipped:
        with pytest.raises(TaskRevokedError, match="skipped: lock 'dedup:"):
            r.get(timeout=5)
    go.touch()
    tokens = [worker.get(s) for s in sent if s.id not in {r.id for r in skipped}]
    events = tasks.read_log(log)
    assert len(events) == KEYS
    assert sorted(e["key"] for e in events) == sorted(set(keys))
    assert sorted(tokens) == sorted(e["token"] for e in events)
    assert held(f"dedup:{run}") == []


def test_queue_scope_enqueues_once_per_key(worker: Worker, log: str) -> None:
    run = uuid.uuid4().hex[:6]
    parked = f"{worker.queue}-parked"  # no worker consumes it yet: count what was enqueued
    keys = [f"{run}-{i % KEYS}" for i in range(DUPLICATES)]
    sent = [worker.send(tasks.dedup_queued, key, log, queue=parked) for key in keys]
    # A refused call returns the AsyncResult of the message that holds its key.
    enqueued = list({s.id: s for s in sent}.values())
    assert len(enqueued) == KEYS
    assert [s.id for s in sent[KEYS:]] == [s.id for s in sent[: DUPLICATES - KEYS]]
    assert worker.queue_size(parked) == KEYS
    assert sorted(i.name for i in held(f"dedup-q:{run}")) == sorted(
        f"dedup-q:{k}" for k in set(keys)
    )
    worker.control("add_consumer", queue=parked)
    try:
        tokens = [worker.get(s) for s in enqueued]
    finally:
        worker.control("cancel_consumer", queue=parked)
    events = tasks.read_log(log)
    assert len(events) == KEYS
    assert sorted(tokens) == sorted(e["token"] for e in events)
    eventually(lambda: held(f"dedup-q:{run}") == [], 10, "queue leases released")


def test_a_copy_of_a_message_holding_a_slot_stores_nothing(redis_worker: Worker, log: str) -> None:
    """With ``limit``, a copy of a running message (same id) is skipped: it must not store
    REVOKED under the id of the run that holds the slot, as a different message's skip does."""
    key = f"slot-copy-{uuid.uuid4().hex[:6]}"
    go = f"{log}.go"
    first = redis_worker.send(tasks.limited_skip, key, log, go)
    redis_worker.send(tasks.limited_skip, key, log, go)
    eventually(lambda: len(tasks.read_log(log)) == 2, 30, "both slots taken")
    redis_worker.send(tasks.limited_skip, key, log, go, task_id=first.id)  # the copy
    other = redis_worker.send(tasks.limited_skip, key, log, go)
    broker = redis.Redis.from_url(redis_worker.broker)
    eventually(lambda: redis_worker.result(other).ready(), 30, "the third message skipped")
    eventually(lambda: broker.llen(redis_worker.queue) == 0, 30, "the copy taken by the worker")
    time.sleep(1)  # the copy's skip would have stored by now
    assert redis_worker.result(other).state == "REVOKED"
    assert redis_worker.result(first).state != "REVOKED"
    Path(go).touch()
    assert redis_worker.get(first) in [e["token"] for e in tasks.read_log(log)]
    assert len(tasks.read_log(log)) == 2


def test_a_message_delivered_twice_runs_its_body_once(redis_worker: Worker, log: str) -> None:
    """Redelivery (acks_late, a visibility timeout) hands the worker the same message again.

    Both copies carry the same ticket. The first adopts it; the second must be
    refused and then follow on_locked ("skip"), not run a second body with
    the same token.
    """
    from celery import Task
    from celery.signals import before_task_publish

    from django_dlock.celery import HEADER

    key = f"twice-{uuid.uuid4().hex[:6]}"
    go = f"{log}.go"
    tickets: list[Any] = []

    def capture(headers: dict[str, Any], **kwargs: Any) -> None:
        if HEADER in headers:
            tickets.append(headers[HEADER])

    before_task_publish.connect(capture, weak=False)
    try:
        sent = redis_worker.send(tasks.dedup_queued, key, log, go)
    finally:
        before_task_publish.disconnect(capture)
    [ticket] = tickets
    eventually(lambda: len(tasks.read_log(log)) == 1, 30, "the first body started")
    # The same message again: same id, arguments and headers.
    with app.connection_for_write(redis_worker.broker) as conn, conn.Producer() as producer:
        Task.apply_async(
            tasks.dedup_queued,
            (key, log, go),
            task_id=sent.id,
            headers={HEADER: ticket},
            producer=producer,
            queue=redis_worker.queue,
        )
    broker = redis.Redis.from_url(redis_worker.broker)
    eventually(lambda: broker.llen(redis_worker.queue) == 0, 30, "the copy taken by the worker")
    time.sleep(2)  # a second body would have started by now
    events = tasks.read_log(log)
    Path(go).touch()
    assert len(events) == 1, events
    # The copy skipped and stored nothing: the result is the first run's, not REVOKED.
    assert redis_worker.get(sent) == events[0]["token"]
    eventually(lambda: held(f"dedup-q:{key}") == [], 10, "the lease released")


# --- lifecycle (Redis broker) -------------------------------------------------------------


@pytest.mark.parametrize("how", ["ok", "fail", "ignore", "reject"])
def test_lock_is_released_however_the_body_ends(redis_worker: Worker, log: str, how: str) -> None:
    key = f"{how}-{uuid.uuid4().hex[:6]}"
    redis_worker.send(tasks.outcome, key, how, log)
    eventually(lambda: len(tasks.read_log(log)) == 1, 30, "the body ran")
    # Well within the 30 s TTL: released, not expired.
    eventually(lambda: held(f"outcome:{key}") == [], 5, "the lock released")


@pytest.mark.parametrize(
    "task",
    [tasks.retry_once, tasks.retry_once_queued, tasks.auto_retry, tasks.auto_retry_queued],
    ids=["retry", "retry-queue-scope", "autoretry", "autoretry-queue-scope"],
)
def test_a_retry_is_not_a_duplicate_of_itself(redis_worker: Worker, log: str, task: Any) -> None:
    key = uuid.uuid4().hex[:6]
    sent = redis_worker.send(task, key, log)
    assert redis_worker.get(sent) == 1
    events = tasks.read_log(log)
    assert [e["retries"] for e in events] == [0, 1]
    assert events[0]["token"] < events[1]["token"] or task.lock_options.scope == "queue"
    if task.lock_options.scope == "queue":
        # The lease went with the retry's message: one token throughout.
        assert events[0]["token"] == events[1]["token"]
    eventually(lambda: held(f"{task.lock_options.key.split(':')[0]}:{key}") == [], 5, "released")


def test_on_locked_retry_runs_once_the_holder_is_done(
    redis_worker: Worker, log: str, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    key = uuid.uuid4().hex[:6]
    first = redis_worker.send(tasks.retry_when_locked, key, log, str(go))
    eventually(lambda: len(tasks.read_log(log)) == 1, 30, "the first body holds the lock")
    second = redis_worker.send(tasks.retry_when_locked, key, log)
    eventually(lambda: redis_worker.result(second).state == "RETRY", 30, "the second retries")
    go.touch()
    assert redis_worker.get(second) > redis_worker.get(first)
    assert len(tasks.read_log(log)) == 2


def test_holder_metadata_names_task_and_worker(
    redis_worker: Worker, log: str, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    key = uuid.uuid4().hex[:6]
    sent = redis_worker.send(tasks.holder, key, log, str(go))
    eventually(lambda: len(tasks.read_log(log)) == 1, 30, "the body holds the lock")
    [info] = held(f"holder:{key}")
    go.touch()
    assert info.holder["task_id"] == sent.id
    assert info.holder["task_name"] == "tests.tasks.holder"
    assert info.holder["worker"] == redis_worker.process.nodename
    assert info.holder["pid"] == tasks.read_log(log)[0]["pid"]
    assert redis_worker.get(sent) == info.token


def test_a_revoked_message_gives_its_queue_lease_back(redis_worker: Worker) -> None:
    key = uuid.uuid4().hex[:6]
    sent = redis_worker.send(tasks.later, key, countdown=2)
    [info] = held(f"later:{key}")
    assert info.holder["task_id"] == sent.id
    redis_worker.control("revoke", task_id=sent.id)
    # The lease would last 62 s; the worker discards the message when it is due.
    eventually(lambda: held(f"later:{key}") == [], 20, "the revoked message's lease released")
    assert redis_worker.result(sent).state == "REVOKED"


def _slow_run(worker: Worker, log: str) -> tuple[str, int]:
    key = uuid.uuid4().hex[:6]
    worker.send(tasks.slow, key, log, 60)
    eventually(lambda: len(tasks.read_log(log)) == 1, 30, "the slow body started")
    assert [i.name for i in held(f"slow:{key}")] == [f"slow:{key}"]
    return key, tasks.read_log(log)[0]["pid"]


def _freed_within_ttl(key: str, since: float) -> None:
    ttl = tasks.slow.lock_options.ttl
    time.sleep(max(0.0, since + ttl + 1 - time.monotonic()))
    assert held(f"slow:{key}") == []


def test_a_terminated_task_does_not_hold_its_lock_past_the_ttl(
    redis_worker: Worker, log: str
) -> None:
    key, _ = _slow_run(redis_worker, log)
    sent_id = next(e["task_id"] for e in tasks.read_log(log))
    redis_worker.control("revoke", task_id=sent_id, terminate=True, signal="SIGKILL")
    _freed_within_ttl(key, time.monotonic())


def test_a_pool_process_killed_mid_task_frees_the_lock_within_ttl(
    redis_worker: Worker, log: str
) -> None:
    key, pid = _slow_run(redis_worker, log)
    os.kill(pid, signal.SIGKILL)
    _freed_within_ttl(key, time.monotonic())


def test_a_whole_worker_killed_mid_task_frees_the_lock_within_ttl(
    redis_servers: Any, log: str
) -> None:
    broker = f"redis://127.0.0.1:{settings.REDIS_PORTS['single']}/3"
    process, results = start_worker("killed", broker)
    try:
        worker = Worker(process, broker, results)
        key, _ = _slow_run(worker, log)
        process.kill()
        _freed_within_ttl(key, time.monotonic())
    finally:
        process.cleanup()


def test_limit_with_defer_runs_every_call_at_most_two_at_once(
    redis_worker: Worker, log: str, tmp_path: Path
) -> None:
    """20 calls over one key, limit=2, on_locked="defer", on 6 prefork processes.

    The bodies count themselves in a flock'd file: never more than 2 inside.
    Every call runs once (none dropped, none twice), and each parked call
    costs one extra broker message, which the test counts and prints.
    """
    key = f"defer-{uuid.uuid4().hex[:6]}"
    counter = str(tmp_path / "inside")
    sent = [redis_worker.send(tasks.limited, key, log, counter, 0.3) for _ in range(20)]
    eventually(
        lambda: len([e for e in tasks.read_log(log) if "inside" in e]) >= 20, 90, "20 bodies ran"
    )
    time.sleep(1)  # a 21st body (a call run twice) would have started by now
    events = tasks.read_log(log)
    bodies = [e for e in events if "inside" in e]
    deferred = [e for e in events if "deferred" in e]
    assert sorted(e["task_id"] for e in bodies) == sorted(s.id for s in sent)
    assert max(e["inside"] for e in bodies) <= 2
    assert max(e["inside"] for e in bodies) == 2  # the limit was used, not just 1
    tokens = [e["token"] for e in bodies]
    assert len(set(tokens)) == 20
    # Each deferred call's result is recorded by the run sent again, under its id.
    assert all(1 <= redis_worker.get(s, timeout=30) <= 2 for s in sent)
    assert locks["celery"].do_list_parked(key) == []
    print(f"\n20 calls, limit=2: {len(deferred)} parked, so {len(deferred)} extra broker messages")


@pytest.mark.parametrize("worker", ["redis", "rabbitmq"], indirect=True)
def test_a_copy_of_a_running_message_is_not_run_again_under_defer(
    worker: Worker, log: str, tmp_path: Path
) -> None:
    """Issue 28 item 10: ``defer`` parked a copy of a running message, then ran it again.

    A copy of the message (what ``acks_late`` or a broker's visibility timeout
    delivers: the same task id, retries and replace nesting) finds the slot
    held by its own first delivery and is parked. When that run ends, the copy
    is dropped, not sent again. A retry and a replacement of the run have the
    same task id but are not copies: they run.
    """
    key = f"copy-{uuid.uuid4().hex[:6]}"
    counter = str(tmp_path / "inside")
    first = worker.send(tasks.limited_one, key, log, counter, 2.0)
    eventually(
        lambda: any(e.get("task_id") == first.id for e in tasks.read_log(log) if "inside" in e),
        30,
        "the first run started",
    )
    for options in ({}, {"retries": 1}, {"replaced_task_nesting": 1}):
        worker.send(tasks.limited_one, key, log, counter, 0.1, task_id=first.id, **options)
    eventually(
        lambda: len([e for e in tasks.read_log(log) if "deferred" in e]) == 3,
        30,
        "the copy, the retry and the replacement parked",
    )
    eventually(
        lambda: len([e for e in tasks.read_log(log) if "inside" in e]) >= 3,
        30,
        "the retry and the replacement ran after the first run",
    )
    time.sleep(4)  # the copy would have been sent and run by now (TTL 3 s)
    bodies = [e for e in tasks.read_log(log) if "inside" in e]
    assert sorted(e["delivery"] for e in bodies) == [[0, 0], [0, 1], [1, 0]]
    assert {e["task_id"] for e in bodies} == {first.id}
    assert locks["celery"].do_list_parked(f"limited1:{key}") == []


def test_parked_calls_survive_a_worker_killed_while_holding(
    redis_servers: Any, log: str, tmp_path: Path
) -> None:
    """Calls parked in the lock service run after the worker is killed and another starts.

    The holder's body dies with its worker (kill -9), so nobody releases its
    slot and nobody pops a parked call. The new worker finds the slot held
    (by a lease that runs out within its 3 s TTL), looks again when it ends,
    and sends the parked calls on, one at a time.
    """
    broker = f"redis://127.0.0.1:{settings.REDIS_PORTS['single']}/1"
    key = f"restart-{uuid.uuid4().hex[:6]}"
    counter = str(tmp_path / "inside")
    process, results = start_worker("restart-a", broker)
    worker = Worker(process, broker, results)
    try:
        sent = [worker.send(tasks.limited_one, key, log, counter, 2.0) for _ in range(4)]
        eventually(
            lambda: (
                len(locks["celery"].do_list_parked(f"limited1:{key}")) == 3
                and len([e for e in tasks.read_log(log) if "inside" in e]) == 1
            ),
            30,
            "one body running and three calls parked",
        )
        # A copy of the running message (acks_late, a visibility timeout) is
        # parked too; its first run dies with the worker, so the copy must run.
        [running] = [e["task_id"] for e in tasks.read_log(log) if "inside" in e]
        worker.send(tasks.limited_one, key, log, counter, 2.0, task_id=running)
        eventually(
            lambda: len(locks["celery"].do_list_parked(f"limited1:{key}")) == 4,
            30,
            "the copy parked",
        )
    finally:
        process.kill()
    first = [e["task_id"] for e in tasks.read_log(log) if "inside" in e]
    parked = {s.id for s in sent} - set(first)
    Path(counter).write_text("0")  # the killed body never counted itself out
    again = CeleryWorker("restart-b", broker, results, process.queue).start()
    try:
        eventually(
            lambda: len([e for e in tasks.read_log(log) if "inside" in e]) == 5,
            60,
            "the three parked calls and the copy ran under the new worker",
        )
    finally:
        again.cleanup()
        process.cleanup()
    bodies = [e for e in tasks.read_log(log) if "inside" in e]
    assert max(e["inside"] for e in bodies) == 1
    assert {e["task_id"] for e in bodies} >= parked
    assert [e["task_id"] for e in bodies].count(running) == 2
    assert locks["celery"].do_list_parked(f"limited1:{key}") == []


@pytest.mark.parametrize("worker", ["rabbitmq"], indirect=True)
def test_a_ticket_naming_another_backend_does_not_run_the_body(worker: Worker, log: str) -> None:
    """A message whose ticket names another lock backend alias, where a live lease of the
    same name could be adopted (the "example" SQLite file every process shares), while the
    task's own backend holds the key: the worker must not adopt it there and run the body.
    Found by review: it adopted on whichever backend the ticket named."""
    from celery import Task

    from django_dlock.celery import HEADER

    key = f"foreign-{uuid.uuid4().hex[:6]}"
    name = f"dedup-q:{key}"
    foreign = locks["example"].acquire(name, ttl=60, renew=False).detach()
    try:
        with locks["celery"].acquire(name, ttl=60):  # the task's own key is held
            with app.connection_for_write(worker.broker) as conn, conn.Producer() as producer:
                sent = Task.apply_async(  # past LockedTask.apply_async: the header as given
                    tasks.dedup_queued,
                    (key, log),
                    headers={HEADER: foreign},
                    producer=producer,
                    queue=worker.queue,
                )
            with pytest.raises(TaskRevokedError, match="skipped"):  # on_locked="skip"
                worker.get(sent)
        assert tasks.read_log(log) == []
        info = locks["example"].get(name)
        assert info is not None and info.token == foreign["token"]  # neither adopted nor ended
    finally:
        locks["example"].release_ticket(foreign)
