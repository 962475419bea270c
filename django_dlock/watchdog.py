"""One renewal thread per process for every held lease.

Each held lease is renewed at a third of its TTL, so two renewals can fail in
a row before it runs out. The thread keeps a heap of due times and weak
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
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lock import HeldLock

_Entry = tuple[float, int, "weakref.ref[HeldLock]", int]

#: Wake the thread to drop released entries once this many wait in the deque.
DRAIN_AT = 4096


class Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._incoming: deque[_Entry] = deque()
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        # When the thread will next wake by itself; read without the lock.
        self._wake_at = math.inf

    def schedule(self, held: HeldLock, delay: float) -> None:
        """Renew ``held`` in ``delay`` seconds, replacing any earlier schedule."""
        held._watch_generation += 1
        due = time.monotonic() + delay
        self._incoming.append((due, next(self._seq), weakref.ref(held), held._watch_generation))
        if self._thread is None:
            self._start()
        elif due < self._wake_at or len(self._incoming) > DRAIN_AT:
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
        held._watch_generation += 1

    def pending(self) -> int:
        """Leases currently scheduled for renewal (stale entries excluded)."""
        with self._cond:
            return sum(1 for entry in [*self._heap, *self._incoming] if _live(entry))

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def _next_due(self) -> HeldLock:
        with self._cond:
            while True:
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
                    continue  # appended while we were draining
                delay = wake_at - time.monotonic()
                if delay <= 0:
                    if self._heap and self._heap[0][0] <= wake_at:
                        held = heapq.heappop(self._heap)[2]()
                        if held is not None:
                            return held
                    continue
                # schedule() appends before it reads _wake_at, and notifies
                # under this lock, so an entry due sooner cannot be missed.
                self._cond.wait(None if math.isinf(delay) else delay)

    def _run(self) -> None:
        while True:
            held = self._next_due()
            held._renew()
            del held


def _live(entry: _Entry) -> bool:
    held = entry[2]()
    return held is not None and held._watch_generation == entry[3]


watchdog = Watchdog()


def _reset_after_fork() -> None:
    global watchdog
    watchdog = Watchdog()


def get_watchdog() -> Watchdog:
    return watchdog


os.register_at_fork(after_in_child=_reset_after_fork)
