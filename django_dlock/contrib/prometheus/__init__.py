"""Prometheus metrics for django-dlock, from its signals (``prometheus_client``).

Turn them on by adding ``"django_dlock.contrib.prometheus"`` to
``INSTALLED_APPS`` (the metrics go to ``prometheus_client``'s default
registry), or by calling :func:`install` yourself. Until then nothing is
connected: the signals have no receivers, and sending one without receivers
costs a length check.

Every metric is labelled by ``backend`` (the alias) and ``pattern``: the key
template a name was made from (``"invoice:{invoice_id}"`` for ``@lock``,
``@locked_task`` and guarded views), else :func:`name_pattern` of the name.
Never the full name: one label value per invoice would grow without bound,
and a name may hold what must not leave the process (an e-mail address).
A process keeps at most ``max_patterns`` distinct patterns; further ones,
and patterns longer than ``MAX_PATTERN_LENGTH`` characters, are counted as
``"~other"`` (a warning is logged the first time).

:func:`metrics_view` serves them to a scraper with the bearer token of
``DLOCK_METRICS_TOKEN`` and to a logged-in user with
``django_dlock.view_lock``; anyone else gets 403.

========================================  =========  ==========================================
Metric                                    Type       What
========================================  =========  ==========================================
``dlock_acquisitions_total``              counter    leases granted (an adopted one is not)
``dlock_contended_acquisitions_total``    counter    of those, refused at least once first
``dlock_timeouts_total``                  counter    acquisitions that gave up at their deadline
``dlock_refused_tries_total``             counter    one-shot tries (``timeout=0``) refused
``dlock_leases_lost_total``               counter    leases their holder found gone
``dlock_breaks_total``                    counter    leases broken by an operator
``dlock_tasks_skipped_total``             counter    locked task calls skipped; label ``scope``
``dlock_tasks_deferred_total``            counter    locked task calls parked for later
``dlock_wait_seconds``                    histogram  time from the start of an acquisition to
                                                     its grant or timeout; label ``outcome``
                                                     (``acquired`` or ``timeout``)
``dlock_hold_seconds``                    histogram  time from grant (or adoption) to release
                                                     or loss; not ended by a hand-over
``dlock_held_leases``                     gauge      leases held by this process now
``dlock_watchdog_lag_seconds``            gauge      how late this process's watchdog sends
                                                     renewals (0 when on time); ``backend`` only
========================================  =========  ==========================================
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden

try:
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        REGISTRY,
        CollectorRegistry,
        Counter,
        Histogram,
        generate_latest,
    )
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "django_dlock.contrib.prometheus needs prometheus_client: "
        "pip install 'django-dlock[prometheus]'."
    ) from e

__all__ = [
    "HOLD_BUCKETS",
    "MAX_PATTERNS",
    "MAX_PATTERN_LENGTH",
    "NO_PREFIX",
    "OTHER",
    "WAIT_BUCKETS",
    "Metrics",
    "install",
    "metrics_view",
    "name_pattern",
    "uninstall",
]

from ... import signals
from ...held import HeldLock
from ...watchdog import get_watchdog
from .. import Installation, Receivers

logger = logging.getLogger("django_dlock")

#: Pattern label for names beyond a process's ``max_patterns``.
OTHER = "~other"
#: Pattern label for names without ``:`` that no key template made.
NO_PREFIX = "~no-prefix"
#: Distinct patterns a process labels by, by default.
MAX_PATTERNS = 200
#: Longer patterns are counted as OTHER: Prometheus servers may refuse long label values.
MAX_PATTERN_LENGTH = 100
#: Buckets of ``dlock_wait_seconds``: a grant on the first try is a round
#: trip (milliseconds); a contended wait lasts as long as a holder's work.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 300)
#: Buckets of ``dlock_hold_seconds``.
HOLD_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)

LABELS = ("backend", "pattern")


def name_pattern(name: str) -> str:
    """The pattern of a name not made from a template: ``"invoice:42"`` -> ``"invoice:*"``.

    The part before the first ``:``, then ``:*``. A name without ``:`` is
    :data:`NO_PREFIX`, whatever it is: it may be a user id or an e-mail
    address, which must not become a label value (nor a new time series each).
    """
    head, sep, _ = name.partition(":")
    return f"{head}:*" if sep else NO_PREFIX


class Metrics(Receivers):
    """The metrics of one :func:`install`: its receivers and collectors."""

    def __init__(
        self,
        registry: CollectorRegistry,
        pattern: Callable[[str], str] = name_pattern,
        max_patterns: int = MAX_PATTERNS,
    ) -> None:
        if max_patterns < 1:
            raise ValueError(f"max_patterns must be at least 1, not {max_patterns!r}.")
        self.registry = registry
        self.pattern_of_name = pattern
        self.max_patterns = max_patterns
        self._patterns: set[str] = set()
        self._warned = False
        self._mutex = threading.Lock()
        # Handles granted here, with their labels: the held-leases gauge
        # counts those still held when scraped (a detached or dropped handle
        # sends no signal, so counting up and down would drift).
        self._held: weakref.WeakKeyDictionary[HeldLock, tuple[str, str]] = (
            weakref.WeakKeyDictionary()
        )
        self.backends: set[str] = set()
        self._per_labels: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}
        kw: dict[str, Any] = {"registry": registry}
        self.acquisitions = Counter("dlock_acquisitions", "Leases granted.", LABELS, **kw)
        self.contended = Counter(
            "dlock_contended_acquisitions",
            "Leases granted after the lock service refused at least once.",
            LABELS,
            **kw,
        )
        self.timeouts = Counter(
            "dlock_timeouts", "Acquisitions that gave up at their deadline.", LABELS, **kw
        )
        self.refused = Counter(
            "dlock_refused_tries",
            "One-shot tries (timeout=0) refused because the lock was held.",
            LABELS,
            **kw,
        )
        self.lost = Counter("dlock_leases_lost", "Leases their holder found gone.", LABELS, **kw)
        self.breaks = Counter("dlock_breaks", "Leases broken by an operator.", LABELS, **kw)
        self.skipped = Counter(
            "dlock_tasks_skipped",
            "Locked task calls skipped because their lock was held.",
            (*LABELS, "scope"),
            **kw,
        )
        self.deferred = Counter(
            "dlock_tasks_deferred", "Locked task calls parked for later.", LABELS, **kw
        )
        self.wait = Histogram(
            "dlock_wait_seconds",
            "Seconds from the start of an acquisition to its grant or timeout.",
            (*LABELS, "outcome"),
            buckets=WAIT_BUCKETS,
            **kw,
        )
        self.hold = Histogram(
            "dlock_hold_seconds",
            "Seconds from a grant or an adoption to its release or loss.",
            LABELS,
            buckets=HOLD_BUCKETS,
            **kw,
        )
        self.state = _StateCollector(self)
        registry.register(self.state)
        self.receivers = [
            (signals.lock_acquired, self.on_acquired),
            (signals.lock_released, self.on_released),
            (signals.lock_lost, self.on_lost),
            (signals.lock_detached, self.on_detached),
            (signals.lock_timeout, self.on_timeout),
            (signals.lock_broken, self.on_broken),
            (signals.task_skipped, self.on_skipped),
            (signals.task_deferred, self.on_deferred),
        ]

    def forked(self) -> None:
        """In a child after ``fork()``: a new mutex (the held gauge skips inherited leases)."""
        self._mutex = threading.Lock()

    def disconnect(self) -> None:
        """Disconnect, and unregister the metrics from their registry."""
        super().disconnect()
        for collector in (
            self.acquisitions, self.contended, self.timeouts, self.refused, self.lost, self.breaks,
            self.skipped, self.deferred, self.wait, self.hold, self.state,
        ):  # fmt: skip
            self.registry.unregister(collector)

    def pattern(self, name: str, template: str | None) -> str:
        """The ``pattern`` label for ``name``: its template, else ``pattern_of_name(name)``."""
        pattern = template if template is not None else self.pattern_of_name(name)
        if pattern in self._patterns:
            return pattern
        with self._mutex:
            if len(pattern) <= MAX_PATTERN_LENGTH and len(self._patterns) < self.max_patterns:
                self._patterns.add(pattern)
                return pattern
            warn, self._warned = not self._warned, True
        if warn:
            logger.warning(
                "django-dlock's metrics count lock %r as pattern %r: %s. Names made from a "
                "key template are labelled by it; for others, pass pattern= to install().",
                name,
                OTHER,
                f"its pattern is over {MAX_PATTERN_LENGTH} characters"
                if len(pattern) > MAX_PATTERN_LENGTH
                else f"this process already labels {self.max_patterns} patterns",
            )
        return OTHER

    def _labels(self, backend: str, name: str, template: str | None) -> tuple[str, str]:
        self.backends.add(backend)
        return backend, self.pattern(name, template)

    # --- receivers --------------------------------------------------------------------

    def _children(self, labels: tuple[str, str]) -> tuple[Any, Any, Any, Any]:
        """The children a grant and its release update, made once per label pair."""
        children = self._per_labels.get(labels)
        if children is None:
            children = self._per_labels[labels] = (
                self.acquisitions.labels(*labels),
                self.contended.labels(*labels),
                self.wait.labels(*labels, "acquired"),
                self.hold.labels(*labels),
            )
        return children

    def on_acquired(
        self, backend: str, name: str, held: HeldLock, waited: float = 0.0, **kwargs: Any
    ) -> None:
        labels = self._labels(backend, name, held.template)
        with self._mutex:
            self._held[held] = labels
        if held.adopted:
            return  # counted where it was granted
        acquisitions, contended, wait, _ = self._children(labels)
        acquisitions.inc()
        if held.contended:
            contended.inc()
        wait.observe(waited)

    def on_released(self, backend: str, name: str, held: HeldLock, **kwargs: Any) -> None:
        self._ended(backend, name, held, kwargs.get("held_for"))

    def on_detached(self, backend: str, name: str, held: HeldLock, **kwargs: Any) -> None:
        """Handed over: no longer held here, and its hold goes on where it is adopted."""
        with self._mutex:
            self._held.pop(held, None)

    def on_lost(self, backend: str, name: str, held: HeldLock, **kwargs: Any) -> None:
        labels = self._ended(backend, name, held, kwargs.get("held_for"))
        self.lost.labels(*labels).inc()

    def _ended(
        self, backend: str, name: str, held: HeldLock, held_for: float | None
    ) -> tuple[str, str]:
        labels = self._labels(backend, name, held.template)
        with self._mutex:
            self._held.pop(held, None)
        if held_for is None:
            held_for = time.monotonic() - held.acquired_at
        self._children(labels)[3].observe(held_for)
        return labels

    def on_timeout(
        self,
        backend: str,
        name: str,
        waited: float,
        template: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        labels = self._labels(backend, name, template)
        if timeout == 0:
            self.refused.labels(*labels).inc()  # a try, not a wait
            return
        self.timeouts.labels(*labels).inc()
        self.wait.labels(*labels, "timeout").observe(waited)

    def on_broken(self, backend: str, name: str, **kwargs: Any) -> None:
        self.breaks.labels(*self._labels(backend, name, None)).inc()

    def on_skipped(
        self, backend: str, name: str, scope: str = "run", template: str | None = None, **kw: Any
    ) -> None:
        self.skipped.labels(*self._labels(backend, name, template), scope).inc()

    def on_deferred(
        self, backend: str, name: str, template: str | None = None, **kwargs: Any
    ) -> None:
        self.deferred.labels(*self._labels(backend, name, template)).inc()

    # --- scraped ----------------------------------------------------------------------

    def held_now(self) -> dict[tuple[str, str], int]:
        """Leases this process holds now, by (backend, pattern)."""
        with self._mutex:
            entries = list(self._held.items())
        counts: dict[tuple[str, str], int] = {}
        for held, labels in entries:
            if not (held.released or held.detached or held.lost or held.inherited):
                counts[labels] = counts.get(labels, 0) + 1
        return counts


class _StateCollector(Collector):
    """``dlock_held_leases`` and ``dlock_watchdog_lag_seconds``, read when scraped."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "dlock_held_leases", "Leases this process holds now.", labels=LABELS
        )
        for labels, count in sorted(self.metrics.held_now().items()):
            held.add_metric(labels, count)
        yield held
        lag = GaugeMetricFamily(
            "dlock_watchdog_lag_seconds",
            "Seconds late this process's watchdog sends renewals (0: on time).",
            labels=("backend",),
        )
        lagging = get_watchdog().lagging()
        for alias in sorted(self.metrics.backends | set(lagging)):
            lag.add_metric((alias,), lagging.get(alias, 0.0))
        yield lag


_installation: Installation[Metrics] = Installation()


def install(
    registry: CollectorRegistry | None = None,
    *,
    pattern: Callable[[str], str] = name_pattern,
    max_patterns: int = MAX_PATTERNS,
) -> Metrics:
    """Register the metrics in ``registry`` (default: prometheus_client's) and connect them.

    ``pattern`` maps a name not made from a template to its label. Once per
    process: a second call returns the metrics already installed, unless
    :func:`uninstall` came first.
    """
    return _installation.install(
        lambda: Metrics(REGISTRY if registry is None else registry, pattern, max_patterns)
    )


def uninstall() -> None:
    """Disconnect the metrics and unregister them from their registry."""
    _installation.uninstall()


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The installed metrics' registry in Prometheus's text format, for a URLconf.

    Only to a request with ``Authorization: Bearer <DLOCK_METRICS_TOKEN>``
    (a scraper), or from an active user with ``django_dlock.view_lock`` (a
    browser, logged in to the admin); 403 to anyone else, and to everyone
    while the setting is unset and nobody is logged in. The exposition names
    the backends' aliases and the patterns of the lock names.

    Any metrics endpoint of that registry serves them as well
    (``prometheus_client.start_http_server``, django-prometheus's view); they
    have access controls of their own, or none.
    """
    if not _may_read_metrics(request):
        return HttpResponseForbidden(
            "The lock metrics need Authorization: Bearer <DLOCK_METRICS_TOKEN>, or a "
            "logged-in user with the django_dlock.view_lock permission.",
            content_type="text/plain",
        )
    installed = _installation.current
    registry = installed.registry if installed is not None else REGISTRY
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


def _may_read_metrics(request: HttpRequest) -> bool:
    token = getattr(settings, "DLOCK_METRICS_TOKEN", None)
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if token and scheme.lower() == "bearer" and presented:
        return hmac.compare_digest(presented.encode(), str(token).encode())
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.has_perm("django_dlock.view_lock"))
