"""Signal receivers off the lease path: the signal-dispatch threads.

The watchdog thread and the renewal threads (``watchdog.Renewer``) keep every
lease of the process alive. A receiver run on one of them holds up the
renewals behind it. Walk through it in time, as it went before:

    t0  The process holds lease A on Redis 1 and lease B on Redis 2, ttl 3.
    t1  Redis 1 stops answering; A's renewal does not come back.
    t3  A runs out: the watchdog thread marks it lost and runs the lock_lost
        receivers, one of which takes 6 s.
    t6  B was due for renewal at t2 and t4; nobody scheduled it, so it runs
        out on Redis 2 and another client acquires it.
    t9  The receiver returns; B's loss is reported about 4 s late.

So a signal sent from one of those threads (``lock_lost``,
``watchdog_lagging``, and ``lock_released`` of a release the renewal thread
makes after a rollback) is queued here and sent from a thread of its own,
``django-dlock-signals-<alias>``: one per backend alias, so that a slow
receiver for one backend's leases does not delay another backend's signals
either. The state the signal reports has changed before it is queued: a lost
handle's ``lost`` is True and its ``ensure()`` raises at once, whatever its
receivers are doing.

Order: the signals of one alias are sent in the order they were queued, and
once a handle has a signal queued, its later signals go behind it, from
whatever thread they are sent (otherwise ``lock_released`` could overtake a
``lock_lost`` still queued). Signals sent from any other thread, with nothing
of their handle queued, are sent there and then, as before.

A receiver that raises is logged (``send_robust`` signals per receiver, as
they always were); even a ``SystemExit`` does not end the thread. A receiver
may call back into the package (acquire, release, extend, list): it runs on
an ordinary thread.

The queue is unbounded: queueing must never block the thread that renews
leases, and dropping a signal would lose a ``lock_lost``. It holds one small
entry per event, and an event needs a lease (each handle sends ``lock_lost``
at most once), so it grows only while receivers are slower than leases are
lost. Each thread ends after IDLE seconds without work and is started again
when needed. After ``fork()`` the child starts with no queue: the parent's
signals are the parent's to send. Signals still queued when the interpreter
exits are not sent.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

logger = logging.getLogger("django_dlock")

_local = threading.local()


def mark_lease_thread() -> None:
    """Called by the watchdog and renewal threads: their signals are queued, not sent."""
    _local.lease_thread = True


def on_lease_thread() -> bool:
    return getattr(_local, "lease_thread", False)


def send_robust(signal: Signal, what: str, **kwargs: Any) -> None:
    """``signal.send_robust(**kwargs)``, logging each receiver that raised."""
    for receiver, result in signal.send_robust(**kwargs):
        if isinstance(result, Exception):
            logger.error("%s receiver %r raised %r", what, receiver, result)


class _Lane:
    """The queue of one backend alias and the thread that empties it."""

    IDLE = 30.0

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[tuple[object | None, str, Callable[[], object]]] = deque()
        # key -> signals of it queued or being sent; a handle appears only meanwhile.
        self._pending: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        self._busy = False

    def has_pending(self, key: object) -> bool:
        return id(key) in self._pending

    def put(self, key: object | None, what: str, send: Callable[[], object]) -> None:
        with self._cond:
            self._queue.append((key, what, send))
            if key is not None:
                self._pending[id(key)] = self._pending.get(id(key), 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"django-dlock-signals-{self.alias}", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until everything queued was sent; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._busy = False
                    self._cond.notify_all()  # wait_idle()
                    if not self._cond.wait(self.IDLE) and not self._queue:
                        self._thread = None  # the next put() starts another
                        return
                key, what, send = self._queue.popleft()
                self._busy = True
            try:
                send()
            except BaseException:
                # Even SystemExit: this thread sends every later signal of the alias.
                logger.exception("A %s receiver raised", what)
            finally:
                if key is not None:
                    with self._cond:
                        left = self._pending[id(key)] - 1
                        if left:
                            self._pending[id(key)] = left
                        else:
                            del self._pending[id(key)]
            del key, send


class Dispatcher:
    """The signal-dispatch threads of this process, one per backend alias."""

    def __init__(self) -> None:
        self._lanes: dict[str, _Lane] = {}
        self._mutex = threading.Lock()

    def _lane(self, alias: str) -> _Lane:
        lane = self._lanes.get(alias)
        if lane is None:
            with self._mutex:
                lane = self._lanes.setdefault(alias, _Lane(alias))
        return lane

    def deliver(
        self, alias: str, key: object | None, what: str, send: Callable[[], object]
    ) -> None:
        """Call ``send`` (which sends signal ``what``) now, or queue it off the lease path.

        Queued on the watchdog and renewal threads, and behind anything of
        ``key`` (the handle the signal is about, or None) already queued.
        Otherwise called here, and what it raises propagates.
        """
        lane = self._lane(alias)
        if on_lease_thread() or (key is not None and lane.has_pending(key)):
            lane.put(key, what, send)
        else:
            send()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every signal queued so far was sent (tests; shutdown hooks)."""
        return all(lane.wait_idle(timeout) for lane in list(self._lanes.values()))


dispatcher = Dispatcher()


def _reset_after_fork() -> None:
    global dispatcher
    dispatcher = Dispatcher()


def get_dispatcher() -> Dispatcher:
    return dispatcher


os.register_at_fork(after_in_child=_reset_after_fork)
