"""django_dlock.contrib.prometheus: every metric counts what it says, from the signals.

The metrics go to a registry of the test's own (``install(registry=...)``)
and are read back through ``get_sample_value`` or, under load, from the
exposition a test project's ``/metrics`` view serves, parsed by
``prometheus_client``'s own parser.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.exceptions import Ignore
from django.conf import settings
from django.test import Client, override_settings

from django_dlock import lock, locks, signals
from django_dlock.celery import HEADER, locked_task
from django_dlock.exceptions import LockLost, LockTimeout
from django_dlock.lag import LAG_PREFIX
from django_dlock.watchdog import get_watchdog
from tests import tasks

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="prometheus_client is not installed (the prometheus extra)"
)
from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from django_dlock.contrib import prometheus  # noqa: E402

FAMILIES = {
    "dlock_acquisitions": "counter",
    "dlock_contended_acquisitions": "counter",
    "dlock_timeouts": "counter",
    "dlock_refused_tries": "counter",
    "dlock_leases_lost": "counter",
    "dlock_breaks": "counter",
    "dlock_tasks_skipped": "counter",
    "dlock_tasks_deferred": "counter",
    "dlock_wait_seconds": "histogram",
    "dlock_hold_seconds": "histogram",
    "dlock_held_leases": "gauge",
    "dlock_watchdog_lag_seconds": "gauge",
}
RECEIVERS = (
    signals.lock_acquired,
    signals.lock_released,
    signals.lock_lost,
    signals.lock_timeout,
    signals.lock_detached,
    signals.lock_broken,
    signals.task_skipped,
    signals.task_deferred,
)


@pytest.fixture
def metrics() -> Iterator[prometheus.Metrics]:
    installed = prometheus.install(registry=CollectorRegistry())
    yield installed
    prometheus.uninstall()


@locked_task(key="metrics-skip:{key}", backend="celery")
def skipping(key: str) -> str:
    return key


@locked_task(key="metrics-defer:{key}", backend="celery", on_locked="defer")
def deferring(key: str) -> str:
    return key


def value(metrics: prometheus.Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_nothing_is_connected_until_installed() -> None:
    """Off, the signals have no receiver of ours: sending one is a length check."""
    before = [len(s.receivers) for s in RECEIVERS]
    prometheus.install(registry=CollectorRegistry())
    during = [len(s.receivers) for s in RECEIVERS]
    prometheus.uninstall()
    assert during == [n + 1 for n in before]
    assert [len(s.receivers) for s in RECEIVERS] == before


def test_a_grant_counts_an_acquisition_a_wait_and_a_hold(
    metrics: prometheus.Metrics, backend_alias: str
) -> None:
    name = f"grant:{uuid.uuid4().hex[:8]}"
    labels = {"backend": backend_alias, "pattern": "grant:*"}
    with lock(name, backend=backend_alias):
        assert value(metrics, "dlock_held_leases", **labels) == 1
        time.sleep(0.05)
    assert value(metrics, "dlock_acquisitions_total", **labels) == 1
    assert value(metrics, "dlock_contended_acquisitions_total", **labels) == 0
    assert value(metrics, "dlock_wait_seconds_count", **labels, outcome="acquired") == 1
    assert value(metrics, "dlock_hold_seconds_count", **labels) == 1
    assert value(metrics, "dlock_hold_seconds_sum", **labels) >= 0.05
    assert value(metrics, "dlock_held_leases", **labels) == 0


def test_a_contended_grant_and_a_timeout(metrics: prometheus.Metrics) -> None:
    name = f"contended:{uuid.uuid4().hex[:8]}"
    labels = {"backend": "locmem", "pattern": "contended:*"}
    holder = locks["locmem"].acquire(name)
    with pytest.raises(LockTimeout):
        locks["locmem"].acquire(name, timeout=0.2)
    with pytest.raises(LockTimeout):
        locks["locmem"].acquire(name, timeout=0)
    assert value(metrics, "dlock_timeouts_total", **labels) == 1
    assert value(metrics, "dlock_wait_seconds_count", **labels, outcome="timeout") == 1
    # At least the timeout, give or take the clock's read (0.1998 was seen).
    assert value(metrics, "dlock_wait_seconds_sum", **labels, outcome="timeout") >= 0.19
    # A one-shot try is not a wait that ran out (skipped tasks, guarded views).
    assert value(metrics, "dlock_refused_tries_total", **labels) == 1
    threading.Timer(0.3, holder.release).start()
    with lock(name, backend="locmem", timeout=5):
        pass
    assert value(metrics, "dlock_acquisitions_total", **labels) == 2
    assert value(metrics, "dlock_contended_acquisitions_total", **labels) == 1
    assert value(metrics, "dlock_wait_seconds_sum", **labels, outcome="acquired") >= 0.25


def test_a_break_and_the_loss_it_causes(metrics: prometheus.Metrics) -> None:
    name = f"broken:{uuid.uuid4().hex[:8]}"
    labels = {"backend": "locmem", "pattern": "broken:*"}
    held = locks["locmem"].acquire(name)
    assert locks["locmem"].break_lock(name, held.token)
    with pytest.raises(LockLost):
        held.ensure()
    assert value(metrics, "dlock_breaks_total", **labels) == 1
    assert value(metrics, "dlock_leases_lost_total", **labels) == 1
    assert value(metrics, "dlock_hold_seconds_count", **labels) == 1
    assert value(metrics, "dlock_held_leases", **labels) == 0


def test_a_detached_lease_is_no_longer_held_here(metrics: prometheus.Metrics) -> None:
    name = f"handed:{uuid.uuid4().hex[:8]}"
    labels = {"backend": "locmem", "pattern": "handed:*"}
    first, second = locks["locmem"].acquire(name + ":1"), locks["locmem"].acquire(name + ":2")
    labels["pattern"] = "handed:*"
    assert value(metrics, "dlock_held_leases", **labels) == 2
    ticket = first.detach()
    assert value(metrics, "dlock_held_leases", **labels) == 1
    adopted = locks["locmem"].adopt(ticket)
    assert value(metrics, "dlock_held_leases", **labels) == 2
    adopted.release()
    second.release()
    assert value(metrics, "dlock_held_leases", **labels) == 0
    # The handed-over lease is one grant and one hold, ended where it was adopted.
    assert value(metrics, "dlock_acquisitions_total", **labels) == 2
    assert value(metrics, "dlock_hold_seconds_count", **labels) == 2


def test_a_templated_name_is_labelled_by_its_template(metrics: prometheus.Metrics) -> None:
    @lock("invoice:{invoice_id}", backend="locmem")
    def pay(invoice_id: int) -> None:
        pass

    for invoice_id in range(5):
        pay(invoice_id)
    assert (
        value(
            metrics, "dlock_acquisitions_total", backend="locmem", pattern="invoice:{invoice_id}"
        )
        == 5
    )
    families = {f.name for f in metrics.registry.collect()}
    assert "dlock_acquisitions" in families


def test_patterns_beyond_the_cap_are_counted_as_other(caplog: pytest.LogCaptureFixture) -> None:
    metrics = prometheus.install(registry=CollectorRegistry(), max_patterns=2)
    try:
        for i in range(4):
            with lock(f"fixed-{i}-{uuid.uuid4().hex[:6]}:1", backend="locmem"):
                pass
        assert len(metrics._patterns) == 2
        assert value(metrics, "dlock_acquisitions_total", backend="locmem", pattern="~other") == 2
    finally:
        prometheus.uninstall()
    assert caplog.text.count("already labels 2 patterns") == 1  # once, not per lock


def test_a_long_pattern_is_counted_as_other(metrics: prometheus.Metrics) -> None:
    """Prometheus servers may refuse a scrape with long label values."""
    with lock("x" * 99 + ":1", backend="locmem"):
        pass
    with lock("y" * 98 + ":1", backend="locmem"):
        pass
    assert value(metrics, "dlock_acquisitions_total", backend="locmem", pattern="~other") == 1
    pattern = "y" * 98 + ":*"
    assert value(metrics, "dlock_acquisitions_total", backend="locmem", pattern=pattern) == 1


def test_a_forked_child_does_not_count_its_parents_leases(metrics: prometheus.Metrics) -> None:
    name = f"forked:{uuid.uuid4().hex[:8]}"
    labels = {"backend": "locmem", "pattern": "forked:*"}
    read, write = os.pipe()
    with lock(name, backend="locmem"):
        pid = os.fork()
        if pid == 0:  # the child: report, then leave at once
            try:
                held = value(metrics, "dlock_held_leases", **labels)
                os.write(write, str(held).encode())
            finally:
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        assert value(metrics, "dlock_held_leases", **labels) == 1
    assert os.waitstatus_to_exitcode(status) == 0
    assert float(os.read(read, 100).decode()) == 0
    os.close(read)


def test_skipped_and_deferred_task_calls(metrics: prometheus.Metrics, redis_servers: Any) -> None:
    key = uuid.uuid4().hex[:8]
    with lock(f"metrics-skip:{key}", backend="celery"):
        assert skipping.apply((key,)).result is None
    labels = {"backend": "celery", "pattern": "metrics-skip:{key}"}
    assert value(metrics, "dlock_tasks_skipped_total", **labels, scope="run") == 1
    defer(deferring, f"metrics-defer:{key}", key)
    labels = {"backend": "celery", "pattern": "metrics-defer:{key}"}
    assert value(metrics, "dlock_tasks_deferred_total", **labels) == 1


def test_a_queue_lease_adopted_by_its_run_keeps_the_task_pattern(
    metrics: prometheus.Metrics, redis_servers: Any, tmp_path: Any
) -> None:
    """The lease taken at enqueue is detached; the run adopts it: both under the key template."""
    key = uuid.uuid4().hex[:8]
    log = str(tmp_path / "log")
    ticket = (
        locks["celery"]
        .acquire(f"dedup-q:{key}", ttl=30, renew=False, template="dedup-q:{key}")
        .detach()
    )
    tasks.dedup_queued.apply((key, log), headers={HEADER: ticket})
    labels = {"backend": "celery", "pattern": "dedup-q:{key}"}
    # One lease: one grant and one wait (at enqueue), one hold (ended by the run).
    assert value(metrics, "dlock_acquisitions_total", **labels) == 1
    assert value(metrics, "dlock_wait_seconds_count", **labels, outcome="acquired") == 1
    assert value(metrics, "dlock_hold_seconds_count", **labels) == 1
    assert value(metrics, "dlock_acquisitions_total", backend="celery", pattern="dedup-q:*") == 0


def defer(task: Any, name: str, key: str) -> None:
    """Run ``task`` as a worker runs a message (its request pushed) while ``name`` is held."""
    task_id = str(uuid.uuid4())
    with lock(name, backend="celery"):
        task.push_request(id=task_id, is_eager=False, called_directly=False, delivery_info={})
        try:
            with pytest.raises(Ignore):
                task(key)
        finally:
            task.pop_request()
    assert locks["celery"].do_unpark_key(name, task_id)


def contend(alias: str, name: str) -> None:
    """One try refused, then one wait granted when the holder lets go: surely contended."""
    holder = locks[alias].acquire(name)
    with pytest.raises(LockTimeout):
        locks[alias].acquire(name, timeout=0)
    threading.Timer(0.1, holder.release).start()
    with lock(name, backend=alias, timeout=5):
        pass


def _load(alias: str, seconds: float, errors: list[BaseException]) -> None:
    """Two names, short holds, shorter timeouts: grants, contention and timeouts."""
    deadline = time.monotonic() + seconds
    i = 0
    try:
        while time.monotonic() < deadline:
            i += 1
            try:
                with lock(f"load:{i % 2}", backend=alias, timeout=0.02):
                    time.sleep(0.01)
            except LockTimeout:
                pass
    except BaseException as e:
        errors.append(e)


@override_settings(
    ROOT_URLCONF="tests.urls",
    DLOCK_BACKENDS={
        **settings.DLOCK_BACKENDS,
        "metrics-lag": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"},
    },
)
def test_exposition_under_load_shows_every_metric(
    metrics: prometheus.Metrics, redis_servers: Any
) -> None:
    """Eight threads on two backends, a break, a lag; /metrics parsed while they run."""
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_load, args=(alias, 2.0, errors))
        for alias in ("redis", "locmem")
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    key = uuid.uuid4().hex[:8]
    with lock(f"metrics-skip:{key}", backend="celery"):
        skipping.apply((key,))
    defer(deferring, f"metrics-defer:{key}", key)
    for alias in ("redis", "locmem"):
        contend(alias, f"load-contended:{key}")
    broken = locks["redis"].acquire(f"load-broken:{key}")
    locks["redis"].break_lock(broken.name, broken.token)
    with pytest.raises(LockLost):
        broken.ensure()
    # The renewal thread of a backend stuck for a while: a real lag.
    free = threading.Event()
    get_watchdog().renewer("metrics-lag").submit(lambda: free.wait(10))
    lagging = locks["metrics-lag"].acquire(f"load-lag:{key}", ttl=1.2)
    time.sleep(1.0)
    free.set()
    deadline = time.monotonic() + 5
    while "metrics-lag" not in get_watchdog().lagging():
        assert time.monotonic() < deadline, "the watchdog did not report its lag"
        time.sleep(0.02)
    held_now = locks["redis"].acquire(f"load-held:{key}")
    with override_settings(DLOCK_METRICS_TOKEN="scrape"):
        response = Client().get("/metrics", headers={"Authorization": "Bearer scrape"})
    for t in threads:
        t.join(10)
    held_now.release()
    lagging.release_quietly()
    for info in locks["metrics-lag"].list(LAG_PREFIX):
        locks["metrics-lag"].do_break(info.name, None)
    assert not errors, errors
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.content.decode())}
    for name, kind in FAMILIES.items():
        assert name in families, f"{name} missing from the exposition"
        assert families[name].type == kind
        assert families[name].samples, f"{name} has no samples"

    def total(family: str, suffix: str = "", **labels: str) -> float:
        return sum(
            s.value
            for s in families[family].samples
            if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items())
        )

    for alias in ("redis", "locmem"):
        assert total("dlock_acquisitions", "_total", backend=alias, pattern="load:*") > 10
        assert total("dlock_contended_acquisitions", "_total", backend=alias) > 0
        assert total("dlock_timeouts", "_total", backend=alias) > 0
        assert total("dlock_wait_seconds", "_count", backend=alias) > 10
        assert total("dlock_hold_seconds", "_count", backend=alias) > 10
    assert total("dlock_breaks", "_total", backend="redis") == 1
    assert total("dlock_leases_lost", "_total", backend="redis") == 1
    assert total("dlock_tasks_skipped", "_total", backend="celery") == 1
    assert total("dlock_tasks_deferred", "_total", backend="celery") == 1
    assert total("dlock_held_leases", "", backend="redis") >= 1
    assert total("dlock_watchdog_lag_seconds", "", backend="metrics-lag") > 0.5
    # Cardinality: no label carries a whole name with a random part.
    patterns = {s.labels.get("pattern") for f in families.values() for s in f.samples}
    assert not [p for p in patterns if p and key in p], patterns


def test_a_failing_metric_never_fails_the_lock(caplog: pytest.LogCaptureFixture) -> None:
    """A receiver's error is logged: lock_acquired's would otherwise release the lease."""

    def pattern(name: str) -> str:
        raise RuntimeError("no pattern for you")

    prometheus.install(registry=CollectorRegistry(), pattern=pattern)
    try:
        with lock(f"failing:{uuid.uuid4().hex[:8]}", backend="locmem") as held:
            assert not held.released
            held.ensure()
    finally:
        prometheus.uninstall()
    assert "Metrics.on_acquired receiver failed" in caplog.text
    assert "no pattern for you" in caplog.text


@override_settings(ROOT_URLCONF="tests.urls")
def test_guarded_views_are_labelled_by_their_key(metrics: prometheus.Metrics) -> None:
    """A view's 409 is a refused try (timeout=0), under the view's key template."""
    client = Client()
    assert client.get("/order/7/").status_code == 200
    with lock("order:8", backend="locmem"):
        assert client.get("/409/order/8/").status_code == 409
    labels = {"backend": "locmem", "pattern": "order:{order_id}"}
    assert value(metrics, "dlock_acquisitions_total", **labels) == 1
    assert value(metrics, "dlock_refused_tries_total", **labels) == 1


@pytest.mark.django_db(transaction=True)
def test_locked_saves_are_labelled_by_their_key(metrics: prometheus.Metrics) -> None:
    from django_dlock.saves import DEFAULT_KEY, locked_save
    from tests.models import Document

    doc = Document.objects.create(title="a")
    locked_save(doc, backend="locmem").release()
    labels = {"backend": "locmem", "pattern": DEFAULT_KEY}
    assert value(metrics, "dlock_acquisitions_total", **labels) == 1
