"""The package's clocks: the wall clock in microseconds, TTLs in milliseconds, and
forward steps of a lock service's clock, seen from here (issue 28).

:func:`wall_micros` and :func:`ms` are the one copy of each conversion the
backends use; the rest of this module is the probe of a service's clock.

A lease ends on the lock service's clock: Redis stores each key's end as a
wall-clock instant, and the database backend compares ``expires_at`` with the
server's clock. A step of that clock ``s`` seconds forward (an operator, a
VM restored, NTP stepping instead of slewing) ends every lease ``s`` seconds
early, and another client can take it at once, while the holder's handle,
which counts on its own monotonic clock, still says it holds the lease.

Where the service's clock can be read in one round trip (a backend whose
``tells_server_time`` is true, with ``do_server_time()``: the clock its leases
end on, seconds since the epoch; Redis ``TIME`` on a single node, the
database's clock; not a Redis Cluster or Redlock, whose masters each have
their own, nor etcd, which tells no time), each process with
leases on that backend reads it every :data:`PROBE_EVERY` seconds and
compares how far it moved with how far ``time.monotonic()`` moved. A
forward step larger than :data:`SLACK` plus the round trips' uncertainty
makes every lease of that backend held here suspect: each is checked on the
service at once, those it no longer holds are marked lost (``lock_lost``),
and the others are renewed at once. Backward steps only make leases last
longer on the service, which costs liveness, not safety: they are ignored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PROBE_EVERY", "SLACK", "ClockProbe", "ClockWatch", "ms", "wall_micros"]

logger = logging.getLogger("django_dlock.watchdog")

#: Seconds between two reads of a backend's clock while it has leases here.
PROBE_EVERY = 1.0
#: A forward step smaller than this (beyond the round trips' uncertainty) is
#: not reported: clocks that slew drift far less between two reads.
SLACK = 0.5


def wall_micros() -> int:
    """This machine's wall clock, in whole microseconds since the epoch.

    Where fencing tokens start on a service that tells no time of its own
    (locmem, etcd's epochs; SQLite's ``dlock_now_us()``), and when a slot was
    taken or a Celery call parked.
    """
    return time.time_ns() // 1000


def ms(seconds: float) -> int:
    """``seconds`` in whole milliseconds, at least one: a TTL as Redis's ``PX`` takes it."""
    return max(1, round(seconds * 1000))


class ClockWatch:
    """Compares successive reads of a service's clock with ``time.monotonic()``."""

    def __init__(self) -> None:
        self._last: tuple[float, float, float] | None = None

    def observe(self, server: float, sent: float, answered: float) -> float:
        """The forward step of the server's clock since the last read, seconds (else 0).

        ``server`` is the server's clock (seconds) read by a call sent at
        ``sent`` and answered at ``answered`` (``time.monotonic()``): it was
        read somewhere in between, so each read is uncertain by half the
        round trip.
        """
        middle, half = (sent + answered) / 2, (answered - sent) / 2
        last, self._last = self._last, (server, middle, half)
        if last is None:
            return 0.0
        step = (server - last[0]) - (middle - last[1])
        return step if step > SLACK + half + last[2] else 0.0


class ClockProbe:
    """Reads one backend's clock while it has leases here; on a forward step, checks them.

    The reads run on a thread of their own, never on the renewal thread: over
    a slow link a read takes as long as a renewal, and renewals must not wait
    for it. ``scheduled()`` lists the leases of the backend that the watchdog
    renews, ``renew_now(held)`` has one renewed at once, ``done()`` runs on
    the probe's thread after each read (it closes that thread's database
    connections, as the renewal thread does after each round: one left open
    on a test database stops ``manage.py test`` from dropping it).
    ``spawn`` and ``sleep`` are the thread and the wait, which the tests
    replace to play a clock step on a virtual clock.
    """

    def __init__(
        self,
        alias: str,
        scheduled: Callable[[], list[Any]],
        renew_now: Callable[[Any], None],
        done: Callable[[], None] = lambda: None,
        spawn: Callable[[Callable[[], None], str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.alias = alias
        self._scheduled = scheduled
        self._renew_now = renew_now
        self._done = done
        self._spawn = spawn or _thread
        self._sleep = sleep
        self._mutex = threading.Lock()
        self._backend: Any = None
        self.running = False
        #: Forward steps seen, seconds (the latest last).
        self.steps: list[float] = []

    def start(self, backend: Any) -> None:
        """Probe ``backend`` from now on, unless already probing."""
        if self.running or not getattr(backend, "tells_server_time", False):
            return
        with self._mutex:
            if self.running:
                return
            self.running = True
            self._backend = backend
        self._spawn(self._run, f"django-dlock-clock-{self.alias}")

    def _run(self) -> None:
        watch = ClockWatch()
        try:
            while True:
                self._sleep(PROBE_EVERY)
                with self._mutex:
                    leases = self._scheduled()
                    if not leases:  # nothing held here: the next renewal starts it again
                        self.running = False
                        return
                try:
                    self._probe(watch, leases)
                finally:
                    self._done()
        finally:
            self._done()

    def _probe(self, watch: ClockWatch, leases: list[Any]) -> None:
        sent = time.monotonic()
        try:
            server = self._backend.do_server_time()
        except Exception:
            logger.debug("Could not read the clock of %r", self.alias, exc_info=True)
            return
        step = watch.observe(server, sent, time.monotonic())
        if step:
            self._stepped(step, leases)

    def _stepped(self, step: float, leases: list[Any]) -> None:
        self.steps.append(step)
        logger.warning(
            "The clock of lock backend %r stepped %.1f s forward: its leases end that much "
            "sooner there. Checking the %d lease(s) held here.",
            self.alias,
            step,
            len(leases),
        )
        for held in leases:
            try:
                ours = held.ops.check(held.name, held.owner)
            except Exception:
                ours = True  # unknown: renewed at once, and judged by that renewal
            if ours:
                self._renew_now(held)
            else:
                held.lost_on_server(
                    f"the clock of backend {self.alias!r} stepped {step:.1f} s forward, "
                    "and the lock service no longer holds the lease"
                )


def _thread(target: Callable[[], None], name: str) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()
