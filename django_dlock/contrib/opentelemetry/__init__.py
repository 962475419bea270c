"""OpenTelemetry spans for django-dlock, from its signals (``opentelemetry-api``).

Call :func:`install` once (in an ``AppConfig.ready()``, after the tracer
provider is set up), or add ``"django_dlock.contrib.opentelemetry"`` to
``INSTALLED_APPS``, which installs it on the global tracer provider. Until
then nothing is connected and the signals cost a length check.

Each acquisition gives two spans, children of the span current where it was
made:

``dlock.wait``
    From the start of the acquisition to its grant, or to its deadline
    (status ERROR, ``dlock.outcome`` = ``"timeout"``; a one-shot try,
    ``timeout=0``, that found the lock held is ``"refused"``, not an error).
    Recorded when the wait ends, with its real start time. A lease adopted
    from a ticket has none (``dlock.adopted`` on its hold span).
``dlock.hold``
    From the grant to the release (``dlock.outcome`` = ``"released"``), the
    hand-over with ``detach()`` (``"detached"``) or the loss of the lease
    (``"lost"``, status ERROR, and the reason as an event). It is not made
    the current span: the signals that start and end it may come from other
    threads (a loss a renewal found ends it on the backend's signal thread),
    so it could not be unset safely.

Attributes: ``dlock.backend`` (alias), ``dlock.name`` (the full lock name:
span attributes are not label dimensions), ``dlock.pattern`` (its key
template, when it was made from one), ``dlock.token`` (the fencing token) and
``dlock.contended``.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

try:
    from opentelemetry import trace
    from opentelemetry.trace import Span, Status, StatusCode, TracerProvider
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "django_dlock.contrib.opentelemetry needs opentelemetry-api: "
        "pip install 'django-dlock[opentelemetry]'."
    ) from e

__all__ = ["SCOPE", "Tracing", "install", "uninstall"]

from ... import signals
from ...held import HeldLock
from .. import Installation, Receivers

#: The instrumentation scope of the spans.
SCOPE = "django_dlock"


def _attributes(backend: str, name: str, template: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {"dlock.backend": backend, "dlock.name": name}
    if template is not None:
        attributes["dlock.pattern"] = template
    return attributes


class Tracing(Receivers):
    """The receivers of one :func:`install`, and the hold spans still open."""

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer(SCOPE, tracer_provider=tracer_provider)
        self._mutex = threading.Lock()
        self._holds: weakref.WeakKeyDictionary[HeldLock, Span] = weakref.WeakKeyDictionary()
        self.receivers = [
            (signals.lock_acquired, self.on_acquired),
            (signals.lock_timeout, self.on_timeout),
            (signals.lock_released, self.on_released),
            (signals.lock_detached, self.on_detached),
            (signals.lock_lost, self.on_lost),
        ]

    def forked(self) -> None:
        """In a child after ``fork()``: a new mutex (its hold spans are the parent's)."""
        self._mutex = threading.Lock()
        self._holds = weakref.WeakKeyDictionary()

    def on_acquired(
        self,
        backend: str,
        name: str,
        token: int,
        held: HeldLock,
        waited: float = 0.0,
        contended: bool = False,
        **kwargs: Any,
    ) -> None:
        now = time.time_ns()
        attributes = _attributes(backend, name, held.template)
        attributes["dlock.token"] = token
        if held.adopted:
            attributes["dlock.adopted"] = True  # handed over: it waited where it was granted
        else:
            attributes["dlock.contended"] = contended
            wait = self.tracer.start_span(
                "dlock.wait", start_time=now - int(waited * 1e9), attributes=attributes
            )
            wait.set_attribute("dlock.outcome", "acquired")
            wait.end(end_time=now)
        hold = self.tracer.start_span("dlock.hold", start_time=now, attributes=attributes)
        with self._mutex:
            self._holds[held] = hold

    def on_timeout(
        self,
        backend: str,
        name: str,
        waited: float,
        template: str | None = None,
        timeout: float | None = None,
        **kw: Any,
    ) -> None:
        now = time.time_ns()
        attributes = _attributes(backend, name, template)
        # A one-shot try (timeout=0) that found the lock held is not an error.
        attributes["dlock.outcome"] = "refused" if timeout == 0 else "timeout"
        wait = self.tracer.start_span(
            "dlock.wait", start_time=now - int(waited * 1e9), attributes=attributes
        )
        if timeout != 0:
            wait.set_status(Status(StatusCode.ERROR, "timed out waiting for the lock"))
        wait.end(end_time=now)

    def _end(self, held: HeldLock, outcome: str, reason: str | None = None) -> None:
        with self._mutex:
            hold = self._holds.pop(held, None)
        if hold is None:
            return  # granted before install()
        hold.set_attribute("dlock.outcome", outcome)
        if reason is not None:
            hold.add_event("lease lost", {"reason": reason})
            hold.set_status(Status(StatusCode.ERROR, f"lease lost: {reason}"))
        hold.end()

    def on_released(self, held: HeldLock, **kwargs: Any) -> None:
        self._end(held, "released")

    def on_detached(self, held: HeldLock, **kwargs: Any) -> None:
        self._end(held, "detached")

    def on_lost(self, held: HeldLock, reason: str | None = None, **kwargs: Any) -> None:
        self._end(held, "lost", reason or "unknown")


_installation: Installation[Tracing] = Installation()


def install(tracer_provider: TracerProvider | None = None) -> Tracing:
    """Connect the spans, on ``tracer_provider`` (default: the global one).

    Once per process: a second call returns what is installed, unless
    :func:`uninstall` came first.
    """
    return _installation.install(lambda: Tracing(tracer_provider))


def uninstall() -> None:
    """Disconnect the spans; hold spans still open are not ended."""
    _installation.uninstall()
