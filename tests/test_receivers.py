"""Signal receivers run off the lease path (issue 28, item 3).

A ``lock_lost`` receiver used to run on the watchdog thread (a lease whose
renewal did not come back) or inline on a renewal thread, mid-batch: a slow
one stopped every backend's renewals. Now receivers of signals raised there
run on a signal thread of the backend alias (``django_dlock/dispatch.py``).

Each test here runs two real redis-servers of its own, so that stopping one
(SIGSTOP: it accepts and never answers) leaves the suite's servers alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction
from django.test import override_settings

from django_dlock import LockLost, LockTimeout, lock, locks
from django_dlock.exceptions import LockNotOwned
from django_dlock.signals import lock_lost, lock_released

from .models import Counter
from .servers import RedisServer, free_port

REDIS = "django_dlock.backends.redis.RedisBackend"
LOCMEM = "django_dlock.backends.locmem.LocMemBackend"
#: Each test its own aliases: a renewal thread's lag state belongs to its alias.
_run = iter(range(10**6))


@pytest.fixture
def two_redis() -> Iterator[tuple[str, str, RedisServer]]:
    """Aliases on two redis-servers of this test; the first server, to stop."""
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed")
    first, second = RedisServer(free_port()).start(), RedisServer(free_port()).start()
    n = next(_run)
    a, b = f"recv-a{n}", f"recv-b{n}"
    # socket_timeout 20: a renewal sent to the stopped server does not come
    # back before its lease runs out, so the watchdog thread marks it lost.
    backends = {
        "default": {"BACKEND": LOCMEM},
        a: {"BACKEND": REDIS, "LOCATION": first.url, "OPTIONS": {"socket_timeout": 20}},
        b: {"BACKEND": REDIS, "LOCATION": second.url},
    }
    try:
        with override_settings(DLOCK_BACKENDS=backends):
            yield a, b, first
    finally:
        if first.process is not None:
            os.kill(first.process.pid, signal.SIGCONT)
        first.cleanup()
        second.cleanup()


def taken_by_another(alias: str, name: str) -> bool:
    """Whether another client can acquire ``name`` now (it then releases it)."""
    try:
        other = locks[alias].acquire(name, timeout=0)
    except LockTimeout:
        return False
    other.release()
    return True


def test_a_slow_lock_lost_receiver_delays_no_other_backends_renewals(
    two_redis: tuple[str, str, RedisServer],
) -> None:
    """A 10 s receiver for a lease on a stopped server; a healthy server's lease lives on.

    Before: the receiver ran on the watchdog thread, nothing was renewed for
    10 s, the second lease (ttl 1.5) ran out and another client took it.
    """
    a, b, first = two_redis
    finish = threading.Event()
    started = threading.Event()
    events: list[tuple[str, str]] = []

    def on_lost(sender: Any, backend: str, name: str, **kwargs: Any) -> None:
        events.append(("lost", name))
        if name == "on-a":
            started.set()
            finish.wait(10)  # the slow receiver
            events.append(("receiver done", name))

    lock_lost.connect(on_lost, weak=False, dispatch_uid="slow-receiver")
    try:
        on_a = lock("on-a", backend=a, ttl=1.5).acquire()
        on_b = lock("on-b", backend=b, ttl=1.5).acquire()
        assert first.process is not None
        os.kill(first.process.pid, signal.SIGSTOP)
        assert started.wait(10), "the lease on the stopped server was never reported lost"
        assert on_a.lost
        with pytest.raises(LockLost):  # the state is there at once, receivers or not
            on_a.ensure()
        # Two TTLs of the second lease while the receiver sleeps.
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            assert not taken_by_another(b, "on-b"), "the healthy lease ran out"
            time.sleep(0.2)
        on_b.ensure()
        # Its own loss is reported while the slow receiver is still asleep.
        locks[b].break_lock("on-b")
        deadline = time.monotonic() + 5
        while ("lost", "on-b") not in events and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ("lost", "on-b") in events
        assert ("receiver done", "on-a") not in events
    finally:
        finish.set()
        lock_lost.disconnect(dispatch_uid="slow-receiver")
    deadline = time.monotonic() + 10
    while ("receiver done", "on-a") not in events and time.monotonic() < deadline:
        time.sleep(0.02)
    assert events.index(("lost", "on-b")) < events.index(("receiver done", "on-a"))


def test_a_lock_lost_receiver_that_raises_is_logged_and_later_signals_still_come(
    two_redis: tuple[str, str, RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    _, b, _ = two_redis
    lost: list[str] = []

    def raises(sender: Any, name: str, **kwargs: Any) -> None:
        lost.append(name)
        if name == "first":
            raise RuntimeError("receiver bug")
        if name == "second":
            raise SystemExit(3)

    lock_lost.connect(raises, weak=False, dispatch_uid="raises")
    try:
        with caplog.at_level(logging.ERROR, logger="django_dlock"):
            handles = {n: lock(n, backend=b, ttl=0.9).acquire() for n in ("first", "second")}
            keep = lock("keep", backend=b, ttl=0.9).acquire()
            for n in handles:
                locks[b].break_lock(n)
            deadline = time.monotonic() + 10
            while len(lost) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)  # the SystemExit's log line
        assert sorted(lost) == ["first", "second"]
        assert "lock_lost receiver" in caplog.text and "receiver bug" in caplog.text
        assert "SystemExit: 3" in caplog.text
        # The signal thread and the renewal thread both outlived them.
        time.sleep(1.5)
        keep.ensure()
        locks[b].break_lock("keep")
        deadline = time.monotonic() + 5
        while "keep" not in lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "keep" in lost
    finally:
        lock_lost.disconnect(dispatch_uid="raises")


def test_a_receiver_that_calls_back_into_the_package_delays_no_renewal(
    two_redis: tuple[str, str, RedisServer],
) -> None:
    """A lock_lost receiver that waits to acquire a lock this process holds.

    Before: it ran on the renewal thread of the backend, so nothing renewed
    ``held`` (ttl 1.5) while it waited, and it acquired ``held``'s lock.
    """
    _, b, _ = two_redis
    seen: dict[str, Any] = {}
    done = threading.Event()

    def reenters(sender: Any, name: str, held: Any, **kwargs: Any) -> None:
        if name != "broken":
            return
        try:
            with pytest.raises(LockNotOwned):
                held.extend()
            with lock("other", backend=b, ttl=5):
                seen["listed"] = sorted(i.name for i in locks[b].list(""))
            try:
                with lock("held", backend=b, ttl=5, timeout=3):
                    seen["held"] = "acquired"
            except LockTimeout:
                seen["held"] = "timed out"
        except BaseException as e:
            seen["error"] = repr(e)
        finally:
            done.set()

    lock_lost.connect(reenters, weak=False, dispatch_uid="reenters")
    try:
        held = lock("held", backend=b, ttl=1.5).acquire()
        broken = lock("broken", backend=b, ttl=1.5).acquire()
        locks[b].break_lock("broken")
        assert done.wait(15)
    finally:
        lock_lost.disconnect(dispatch_uid="reenters")
    assert broken.lost
    assert "error" not in seen, seen["error"]
    assert seen["listed"] == ["held", "other"]
    assert seen["held"] == "timed out"  # held was renewed all along
    held.ensure()
    held.release()


def test_lock_released_after_a_loss_stays_behind_the_queued_lock_lost(
    two_redis: tuple[str, str, RedisServer],
) -> None:
    """Per handle, signals keep their order: one queued holds back the handle's next.

    ``later`` is marked lost on the renewal thread (as when its renewal does
    not come back in time) while a slow receiver of another loss runs: its
    ``lock_lost`` is queued. The release that follows is granted (the server
    still had the lease), and its ``lock_released``, sent from this thread,
    goes behind that ``lock_lost``, not before it.
    """
    from django_dlock.dispatch import get_dispatcher
    from django_dlock.watchdog import get_watchdog

    _, b, _ = two_redis
    finish = threading.Event()
    order: list[tuple[str, str]] = []

    def on_lost(sender: Any, name: str, **kwargs: Any) -> None:
        order.append(("lost", name))
        if name == "slow":
            finish.wait(10)

    def on_released(sender: Any, name: str, **kwargs: Any) -> None:
        order.append(("released", name))

    lock_lost.connect(on_lost, weak=False, dispatch_uid="order-lost")
    lock_released.connect(on_released, weak=False, dispatch_uid="order-released")
    try:
        slow = lock("slow", backend=b, ttl=0.9).acquire()
        later = lock("later", backend=b, ttl=30).acquire()
        locks[b].break_lock("slow")
        deadline = time.monotonic() + 10
        while order != [("lost", "slow")] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert order == [("lost", "slow")]
        get_watchdog().renewer(b).submit(lambda: later._mark_lost("marked lost by the test"))
        while not later.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        # Granted: lock_released, queued behind lock_lost; then LockLost, as
        # the handle had been declared lost (issue 28 #2: never a quiet end).
        with pytest.raises(LockLost, match="declared lost"):
            later.release()
        assert order == [("lost", "slow")]
        finish.set()
        assert get_dispatcher().wait_idle(10)
    finally:
        finish.set()
        lock_lost.disconnect(dispatch_uid="order-lost")
        lock_released.disconnect(dispatch_uid="order-released")
    assert slow.lost
    assert order == [("lost", "slow"), ("lost", "later"), ("released", "later")]


@pytest.mark.backends("db-postgresql", "db-mysql")
@pytest.mark.with_default_db
def test_a_slow_lock_released_receiver_after_a_rollback_delays_no_renewal(
    backend_alias: str, name: str
) -> None:
    """After a rollback the database backend releases on its renewal thread.

    Before: ``lock_released`` receivers ran there too, and a slow one kept
    the backend's other leases from being renewed: ``keep`` (ttl 1.5) ran out
    and another client took it.
    """
    db = settings.CONFORMANCE_BACKENDS[backend_alias]
    finish = threading.Event()
    released = threading.Event()

    def slow(sender: Any, name: str, **kwargs: Any) -> None:
        if name == rolled_back:
            released.set()
            finish.wait(10)

    rolled_back, kept = f"{name}:rolled-back", f"{name}:keep"
    lock_released.connect(slow, weak=False, dispatch_uid="slow-released")
    try:
        keep = lock(kept, backend=backend_alias, ttl=1.5).acquire()
        with pytest.raises(RuntimeError, match="roll back"):
            with transaction.atomic(using=db):
                with lock(rolled_back, backend=backend_alias, release_on_commit=True, using=db):
                    Counter.objects.using(db).create(value=1)
                raise RuntimeError("roll back")
        assert released.wait(10), "the release after the rollback sent no lock_released"
        until = time.monotonic() + 3.0  # two TTLs of keep while the receiver sleeps
        while time.monotonic() < until:
            assert not taken_by_another(backend_alias, kept), "the other lease ran out"
            time.sleep(0.2)
        keep.ensure()
    finally:
        finish.set()
        lock_released.disconnect(dispatch_uid="slow-released")
    keep.release()


def _child_gets_its_lock_lost(queue: Any, name: str) -> None:
    got = threading.Event()

    def on_lost(sender: Any, **kwargs: Any) -> None:
        if kwargs["name"] == f"{name}:child":
            got.set()

    lock_lost.connect(on_lost, weak=False, dispatch_uid="child-lost")
    held = lock(f"{name}:child", backend="locmem", ttl=0.3).acquire()
    locks["locmem"].break_lock(f"{name}:child")  # its renewal is refused: lost
    queue.put((got.wait(10), held.lost))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
# Forking a threaded process is the point: Celery's prefork pool does it.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_while_a_receiver_runs_sends_its_own_signals(name: str) -> None:
    """The parent's signal thread is busy at the fork; the child starts its own."""
    import multiprocessing

    finish = threading.Event()
    started = threading.Event()

    def slow(sender: Any, **kwargs: Any) -> None:
        if kwargs["name"] == f"{name}:parent":
            started.set()
            finish.wait(10)

    lock_lost.connect(slow, weak=False, dispatch_uid="parent-slow")
    try:
        parent = lock(f"{name}:parent", backend="locmem", ttl=0.3).acquire()
        locks["locmem"].break_lock(f"{name}:parent")
        assert started.wait(10)
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_child_gets_its_lock_lost, args=(queue, name))
        child.start()
        got, lost = queue.get(timeout=30)
        child.join(30)
    finally:
        finish.set()
        lock_lost.disconnect(dispatch_uid="parent-slow")
    assert parent.lost and lost
    assert got, "the child's lock_lost was never sent"


def test_a_watchdog_lagging_receiver_that_waits_for_a_held_lock_delays_no_renewal() -> None:
    """A ``watchdog_lagging`` receiver that waits 3 s to acquire a lease this process holds.

    Before: it ran on the renewal thread, which renewed nothing meanwhile, so
    the lease (ttl 1.8) ran out and the receiver got it.
    """
    from django_dlock.lag import LAG_PREFIX
    from django_dlock.signals import watchdog_lagging
    from django_dlock.watchdog import get_watchdog

    alias = f"recv-lag{next(_run)}"
    seen: list[str] = []
    done = threading.Event()

    def waits(sender: Any, backend: str, **kwargs: Any) -> None:
        if backend != alias:
            return
        try:
            with lock("first", backend=alias, ttl=5, timeout=3):
                seen.append("acquired")
        except LockTimeout:
            seen.append("timed out")
        finally:
            done.set()

    backends = {"default": {"BACKEND": LOCMEM}, alias: {"BACKEND": LOCMEM}}
    watchdog_lagging.connect(waits, weak=False, dispatch_uid="lag-waits")
    try:
        with override_settings(DLOCK_BACKENDS=backends):
            free = threading.Event()
            get_watchdog().renewer(alias).submit(lambda: free.wait(1.2))  # hold it up
            first = lock("first", backend=alias, ttl=1.8).acquire()  # due 0.6, sent 1.2: late
            assert done.wait(15), "no lag was reported"
            assert seen == ["timed out"]  # first was renewed all along
            first.ensure()
            first.release()
            for info in locks[alias].list(LAG_PREFIX):
                locks[alias].do_break(info.name, None)
    finally:
        watchdog_lagging.disconnect(dispatch_uid="lag-waits")
