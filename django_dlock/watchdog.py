"""One renewal thread per process for every held lease.

Each held lease is renewed at a third of its TTL, so two renewals can fail in
a row before it runs out. The watchdog thread only schedules: the renewal
calls run on one thread per backend alias (``renewer.Renewer``), so that one
slow or unreachable service never delays another backend's renewals, and a
renewal that has not come back when its lease runs out marks the lease lost
then (``HeldLock.on_watchdog``). The thread keeps a heap of due times and weak
references: a handle that nobody references any more is simply not renewed
and its lease expires on the server, which is how a forgotten lock still ends.

Scheduling is on every acquisition's path, so it is an append to a deque; the
thread moves new entries into its heap when it wakes. Most locks are released
long before their first renewal, and their entries are dropped unread. The
thread is woken early only when a new entry is due before its current sleep
ends.

After ``fork()`` the child starts with an empty watchdog: the parent's leases
belong to the parent, and a child renewing them would keep them alive after
the parent died.

On a backend whose leases share one server-side lease (etcd's session lease,
``supports_shared_leases``), renewing any handle keeps every key under it
alive, a forgotten one included. There the handle's finalizer asks the
watchdog to release the forgotten lease when it would have run out
(:meth:`Watchdog.call_at`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .dispatch import mark_lease_thread
from .renewer import LAG_QUIET, Renewer

if TYPE_CHECKING:
    # The handle's side the watchdog uses, named as the handle it is.
    from .backends.protocol import Renewable as HeldLock

logger = logging.getLogger("django_dlock")

# (due, seq, handle, generation, early): due at ``due``; taken from ``early`` on
# along with an entry that is due.
_Entry = tuple[float, int, "weakref.ref[HeldLock]", int, float]

#: Wake the thread to drop released entries once this many wait in the deque.
DRAIN_AT = 4096
#: A renewal may go this share of its delay early (at most EARLY_MAX seconds),
#: so that renewals due close together go in one batch.
EARLY_SHARE = 0.02
EARLY_MAX = 0.25


class Watchdog:
    """The heap of due renewals and its thread.

    It schedules any object with an int attribute ``watchdog_generation``
    (which it owns: bumping it makes earlier entries stale) and an
    ``on_watchdog()`` method, which it calls on its thread when the entry is
    due: :class:`~django_dlock.held.HeldLock` and one-off timers.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._incoming: deque[_Entry] = deque()
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        # When the thread will next wake by itself; read without the lock.
        self._wake_at = math.inf
        # call_at() actions not run yet (the heap holds them weakly).
        self._timers: set[_Timer] = set()
        self._renewers: dict[str, Renewer] = {}

    def schedule(self, held: HeldLock, delay: float) -> None:
        """Renew ``held`` in ``delay`` seconds, replacing any earlier schedule."""
        held.watchdog_generation += 1
        due = time.monotonic() + delay
        early = due - min(delay * EARLY_SHARE, EARLY_MAX)
        self._incoming.append(
            (due, next(self._seq), weakref.ref(held), held.watchdog_generation, early)
        )
        if self._thread is None:
            self._start()
        elif due < self._wake_at or len(self._incoming) > DRAIN_AT:
            with self._cond:
                self._cond.notify()

    def call_at(self, due: float, action: Callable[[], None]) -> None:
        """Run ``action`` on the watchdog thread at ``time.monotonic()`` instant ``due``.

        Safe to call from a finalizer, which may run in any thread, the
        watchdog's own included, while it holds its lock.
        """
        timer = _Timer(self, action)
        self._timers.add(timer)
        timer.watchdog_generation += 1
        ref: weakref.ref[HeldLock] = weakref.ref(timer)  # type: ignore[arg-type]
        self._incoming.append((due, next(self._seq), ref, timer.watchdog_generation, due))
        if self._thread is None:
            threading.Thread(target=self._start, daemon=True).start()
        elif self._cond.acquire(blocking=False):
            try:
                self._cond.notify()
            finally:
                self._cond.release()
        else:
            # Whoever holds the lock may be this very thread: wake it from another.
            threading.Thread(target=self._wake, daemon=True).start()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _start(self) -> None:
        with self._cond:
            # The thread never returns (_renew() does not raise), and a forked
            # child gets a new Watchdog, so one start per instance is enough.
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="django-dlock-watchdog", daemon=True
                )
                self._thread.start()

    def cancel(self, held: HeldLock) -> None:
        # Entries are dropped lazily: bumping the generation makes them stale.
        # A lost race leaves a live-looking entry for a released handle, and
        # _renew() ignores handles that are no longer held.
        held.watchdog_generation += 1

    def pending(self) -> int:
        """Leases currently scheduled for renewal (stale entries excluded)."""
        with self._cond:
            return sum(1 for entry in [*self._heap, *self._incoming] if _live(entry))

    def scheduled(self, alias: str) -> list[HeldLock]:
        """The leases of backend ``alias`` the watchdog renews: scheduled, or with its renewer.

        Those with the renewer count (queued, or a renewal in flight): a lease
        lost on the server mid-renewal must be found here too.
        """
        with self._cond:
            entries = [*self._heap, *self._incoming]
            renewer = self._renewers.get(alias)
        leases: dict[int, HeldLock] = {}
        if renewer is not None:
            leases.update((id(held), held) for held in renewer.leases())
        for entry in entries:
            held = entry[2]()
            if held is None or held.watchdog_generation != entry[3]:
                continue
            if getattr(held, "alias", None) == alias:  # not a one-off timer
                leases[id(held)] = held
        return list(leases.values())

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def _next_due(self) -> list[tuple[HeldLock, float]]:
        """Wait for the next due entry; each live entry taken with it, and its due time.

        With the first entry due, every entry whose ``early`` instant has come
        is taken too: renewals due within the next fraction of a second go in
        the same batch, and the thread wakes a few times a second, not once
        a lease.
        """
        with self._cond:
            while True:
                due, wake_at = self._collect()
                if due:
                    return due
                if due is None:
                    continue  # appended while we were draining
                delay = wake_at - time.monotonic()
                if delay <= 0:
                    continue
                # schedule() appends before it reads _wake_at, and notifies
                # under this lock, so an entry due sooner cannot be missed.
                self._cond.wait(None if math.isinf(delay) else delay)

    def _collect(self) -> tuple[list[tuple[HeldLock, float]] | None, float]:
        """Under the lock: the entries due now, and when to wake; None if more came in."""
        # Sleep no later than the earliest due time among entries just
        # dropped as released: entries scheduled after them are due
        # later, so schedule() need not wake us for each of them.
        now = time.monotonic()
        wake_at = math.inf
        while self._incoming:
            entry = self._incoming.popleft()
            if _live(entry):
                heapq.heappush(self._heap, entry)
            elif now < entry[0] < wake_at:
                wake_at = entry[0]
        while self._heap and not _live(self._heap[0]):
            heapq.heappop(self._heap)
        if self._heap:
            wake_at = min(wake_at, self._heap[0][0])
        self._wake_at = wake_at
        if self._incoming:
            return None, wake_at
        now = time.monotonic()
        due: list[tuple[HeldLock, float]] = []
        while self._heap and self._heap[0][4] <= now:
            entry = heapq.heappop(self._heap)
            held = entry[2]()
            if held is not None and held.watchdog_generation == entry[3]:
                due.append((held, entry[0]))
        return due, wake_at

    def renewer(self, alias: str) -> Renewer:
        """The thread that talks to backend ``alias`` for this watchdog."""
        renewer = self._renewers.get(alias)
        if renewer is None:
            with self._cond:
                renewer = self._renewers.setdefault(alias, Renewer(self, alias))
        return renewer

    def lagging(self) -> dict[str, float]:
        """The backends whose renewals this process is late sending: alias -> seconds late."""
        now = time.monotonic()
        return {
            alias: renewer.lag
            for alias, renewer in list(self._renewers.items())
            if renewer.lag is not None and now - renewer.last_late <= LAG_QUIET
        }

    def _run(self) -> None:
        mark_lease_thread()
        while True:
            for held, due in self._next_due():
                held.on_watchdog(due)
            del held
            for renewer in list(self._renewers.values()):
                renewer.flush()


class _Timer:
    """A one-off action, scheduled on the heap like a renewal."""

    def __init__(self, watchdog: Watchdog, action: Callable[[], None]) -> None:
        self._watchdog = watchdog
        self._action = action
        self.watchdog_generation = 0

    def on_watchdog(self, due: float) -> None:
        self._watchdog._timers.discard(self)
        try:
            self._action()
        except BaseException:  # a receiver's SystemExit must not end the watchdog thread
            logger.exception("A watchdog action failed")


def _live(entry: _Entry) -> bool:
    held = entry[2]()
    return held is not None and held.watchdog_generation == entry[3]


watchdog = Watchdog()


def _reset_after_fork() -> None:
    global watchdog
    watchdog = Watchdog()


def get_watchdog() -> Watchdog:
    return watchdog


os.register_at_fork(after_in_child=_reset_after_fork)
