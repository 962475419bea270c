"""Review of batched renewals (issue 19): regressions found, each failing on 9fbf39f."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

import django_dlock.renewer as renewer_module
import django_dlock.watchdog as watchdog_module
from django_dlock import lock, locks
from django_dlock.lag import LAG_PREFIX
from django_dlock.signals import lock_lost, watchdog_lagging
from django_dlock.watchdog import get_watchdog

LOCMEM = "django_dlock.backends.locmem.LocMemBackend"


@pytest.fixture
def alias(request: pytest.FixtureRequest) -> Iterator[str]:
    """A backend of its own per test: its renewal thread's lag state is the test's."""
    alias = f"review-{request.node.name}"[:60]
    with override_settings(
        DLOCK_BACKENDS={"default": {"BACKEND": LOCMEM}, alias: {"BACKEND": LOCMEM}}
    ):
        yield alias
        for info in locks[alias].list(LAG_PREFIX):
            locks[alias].do_break(info.name, None)


def hold_renewer(alias: str, seconds: float) -> threading.Event:
    """Keep the renewal thread of ``alias`` busy (as test_renewals.py does) until set."""
    free = threading.Event()
    get_watchdog().renewer(alias).submit(lambda: free.wait(seconds))
    return free


def test_a_lease_extended_by_hand_while_its_renewal_waits_is_not_lost(alias: str) -> None:
    free = hold_renewer(alias, 5)
    try:
        held = lock("x", backend=alias, ttl=1.2).acquire()
        time.sleep(0.6)  # its renewal (due at 0.4) waits in the queue
        held.extend(30)
        time.sleep(1.0)  # past the lease's old end
        assert not held.lost, held.lost_reason
    finally:
        free.set()
    held.ensure()
    held.release()


def test_a_lock_lost_receiver_that_exits_does_not_strand_the_rest_of_its_batch(alias: str) -> None:
    def exits(sender: Any, name: str, **kwargs: Any) -> None:
        if name == "a":
            sys.exit(1)

    lock_lost.connect(exits, dispatch_uid="review-exits")
    try:
        handles = [lock(n, backend=alias, ttl=0.9).acquire() for n in "abc"]
        locks[alias].break_lock("a")
        time.sleep(2.0)
    finally:
        lock_lost.disconnect(dispatch_uid="review-exits")
    for held in handles[1:]:
        held.ensure()
        held.release()


def test_a_watchdog_lagging_receiver_that_exits_does_not_end_the_renewal_thread(
    alias: str,
) -> None:
    watchdog_lagging.connect(
        lambda sender, **kw: sys.exit(1), dispatch_uid="review-lag-exits", weak=False
    )
    try:
        free = hold_renewer(alias, 1.2)
        first = lock("first", backend=alias, ttl=1.8).acquire()  # due 0.6, sent 1.2: late
        time.sleep(1.5)
        free.set()
        later = lock("later", backend=alias, ttl=0.9).acquire()
        time.sleep(1.5)
        later.ensure()
        first.ensure()
    finally:
        watchdog_lagging.disconnect(dispatch_uid="review-lag-exits")
    later.release()
    first.release()


def test_leases_that_ran_out_waiting_are_reported_as_lag(alias: str) -> None:
    reports: list[dict[str, Any]] = []
    watchdog_lagging.connect(
        lambda sender, **kw: reports.append(kw), dispatch_uid="review-lag", weak=False
    )
    try:
        free = hold_renewer(alias, 1.5)
        handles = [lock(f"z{i}", backend=alias, ttl=0.9).acquire() for i in range(3)]
        time.sleep(2.0)
        free.set()
        deadline = time.monotonic() + 5
        while not reports and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watchdog_lagging.disconnect(dispatch_uid="review-lag")
    assert all(held.lost for held in handles)
    assert len(reports) == 1 and reports[0]["lost"] == 3


def test_a_second_lag_episode_is_reported(alias: str, monkeypatch: Any) -> None:
    # Read by the renewal thread (renewer.py) and by Watchdog.lagging().
    monkeypatch.setattr(renewer_module, "LAG_QUIET", 1.0)
    monkeypatch.setattr(watchdog_module, "LAG_QUIET", 1.0)
    reports: list[dict[str, Any]] = []
    watchdog_lagging.connect(
        lambda sender, **kw: reports.append(kw), dispatch_uid="review-lag2", weak=False
    )
    try:
        for _ in range(2):
            free = hold_renewer(alias, 1.2)
            held = lock("x", backend=alias, ttl=1.8).acquire()  # due 0.6, sent 1.2: late
            time.sleep(1.5)
            free.set()
            held.release()
            time.sleep(1.5)  # longer than LAG_QUIET with no late renewal
    finally:
        watchdog_lagging.disconnect(dispatch_uid="review-lag2")
    assert len(reports) == 2


def test_a_slow_watchdog_lagging_receiver_does_not_hold_up_the_round(alias: str) -> None:
    watchdog_lagging.connect(
        lambda sender, **kw: time.sleep(1.5), dispatch_uid="review-slow", weak=False
    )
    try:
        free = hold_renewer(alias, 1.2)
        held = lock("x", backend=alias, ttl=1.8).acquire()  # due 0.6, taken 1.2, ends 1.8
        time.sleep(3.0)
        free.set()
    finally:
        watchdog_lagging.disconnect(dispatch_uid="review-slow")
    assert not held.lost, held.lost_reason
    held.release()


def test_a_lease_that_would_run_out_before_its_renewal_came_back_is_not_sent(
    alias: str,
) -> None:
    """Under overload, a renewal that cannot come back in time is given up, not sent.

    The service has answered slowly (a recent call took 1 s), and the lease's
    renewal waited in the queue until 0.3 s were left (less than ttl/6 and
    than twice that call): sending it would cost a call and save nothing.
    """
    backend = locks[alias]
    sent: list[str] = []
    original = type(backend).do_extend_many

    def recording(self: Any, leases: Any) -> list[bool | Exception]:
        sent.extend(n for n, _, _ in leases)
        return original(self, leases)

    renewer = get_watchdog().renewer(alias)
    renewer._round_trip = 1.0  # what a slow service's calls left behind
    type(backend).do_extend_many = recording  # type: ignore[method-assign]
    try:
        free = hold_renewer(alias, 10)
        held = lock("x", backend=alias, ttl=3).acquire()  # due at 1.0, ends at 3.0
        time.sleep(held.expires_in - 0.3)
        free.set()
        deadline = time.monotonic() + 3
        while not held.lost and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        free.set()
        del type(backend).do_extend_many
    assert held.lost and "could not be sent" in (held.lost_reason or "")
    assert "x" not in sent
