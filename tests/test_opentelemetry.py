"""django_dlock.contrib.opentelemetry: a span for the wait and one for the hold.

The spans are recorded by the OpenTelemetry SDK's own tracer provider and
in-memory exporter, on every backend.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from django_dlock import lock, locks
from django_dlock.exceptions import LockLost, LockTimeout

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed")
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from django_dlock.contrib import opentelemetry as dlock_otel


@pytest.fixture
def spans() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dlock_otel.install(tracer_provider=provider)
    yield exporter, provider
    dlock_otel.uninstall()


def finished(exporter: InMemorySpanExporter, name: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_a_wait_span_and_a_hold_span_with_token_and_backend(
    spans: tuple[InMemorySpanExporter, TracerProvider], backend_alias: str
) -> None:
    exporter, provider = spans
    name = f"traced:{uuid.uuid4().hex[:8]}"
    parent = provider.get_tracer("test").start_as_current_span("request")
    with parent as request_span:
        with lock(name, backend=backend_alias) as held:
            time.sleep(0.02)
    (wait,) = finished(exporter, "dlock.wait")
    (hold,) = finished(exporter, "dlock.hold")
    for span in (wait, hold):
        assert span.attributes["dlock.backend"] == backend_alias
        assert span.attributes["dlock.name"] == name
        assert span.attributes["dlock.token"] == held.token
        assert span.parent.span_id == request_span.get_span_context().span_id
    assert wait.attributes["dlock.outcome"] == "acquired"
    assert hold.attributes["dlock.outcome"] == "released"
    assert wait.end_time <= hold.start_time
    assert hold.end_time - hold.start_time >= 20_000_000
    assert hold.status.status_code is StatusCode.UNSET


def test_a_contended_wait_spans_the_wait_and_a_timeout_is_an_error(
    spans: tuple[InMemorySpanExporter, TracerProvider],
) -> None:
    exporter, _ = spans
    name = f"traced-wait:{uuid.uuid4().hex[:8]}"
    holder = locks["locmem"].acquire(name)
    with pytest.raises(LockTimeout):
        locks["locmem"].acquire(name, timeout=0.1)
    with pytest.raises(LockTimeout):
        locks["locmem"].acquire(name, timeout=0)
    threading.Timer(0.2, holder.release).start()
    with lock(name, backend="locmem", timeout=5):
        pass
    waits = finished(exporter, "dlock.wait")
    timed_out = [s for s in waits if s.attributes["dlock.outcome"] == "timeout"]
    granted = [s for s in waits if s.attributes.get("dlock.contended")]
    assert len(timed_out) == 1 and timed_out[0].status.status_code is StatusCode.ERROR
    refused = [s for s in waits if s.attributes["dlock.outcome"] == "refused"]
    assert len(refused) == 1 and refused[0].status.status_code is StatusCode.UNSET
    assert timed_out[0].end_time - timed_out[0].start_time >= 100_000_000
    assert len(granted) == 1
    assert granted[0].end_time - granted[0].start_time >= 150_000_000


def test_a_lost_lease_ends_its_hold_span_as_an_error(
    spans: tuple[InMemorySpanExporter, TracerProvider],
) -> None:
    exporter, _ = spans
    held = locks["locmem"].acquire(f"traced-lost:{uuid.uuid4().hex[:8]}")
    locks["locmem"].break_lock(held.name, held.token)
    with pytest.raises(LockLost):
        held.ensure()
    (hold,) = finished(exporter, "dlock.hold")
    assert hold.attributes["dlock.outcome"] == "lost"
    assert hold.status.status_code is StatusCode.ERROR
    assert [e.name for e in hold.events] == ["lease lost"]


def test_a_detached_lease_ends_its_hold_here_and_starts_one_where_adopted(
    spans: tuple[InMemorySpanExporter, TracerProvider],
) -> None:
    exporter, _ = spans
    held = locks["locmem"].acquire(f"traced-handed:{uuid.uuid4().hex[:8]}")
    adopted = locks["locmem"].adopt(held.detach())
    adopted.release()
    holds = finished(exporter, "dlock.hold")
    assert [s.attributes["dlock.outcome"] for s in holds] == ["detached", "released"]
    assert holds[1].attributes["dlock.adopted"] is True
    assert len(finished(exporter, "dlock.wait")) == 1  # the adoption waited for nothing


def test_a_templated_name_carries_its_pattern(
    spans: tuple[InMemorySpanExporter, TracerProvider],
) -> None:
    exporter, _ = spans

    @lock("traced-invoice:{invoice_id}", backend="locmem")
    def pay(invoice_id: int) -> None:
        pass

    pay(7)
    (hold,) = finished(exporter, "dlock.hold")
    assert hold.attributes["dlock.pattern"] == "traced-invoice:{invoice_id}"
    assert hold.attributes["dlock.name"] == "traced-invoice:7"
