"""One renewal thread per process for every held lease.

Each held lease is renewed at a third of its TTL, so two renewals can fail in
a row before it runs out. The thread keeps a heap of due times and weak
references: a handle that nobody references any more is simply not renewed
and its lease expires on the server, which is how a forgotten lock still ends.

After ``fork()`` the child starts with an empty watchdog: the parent's leases
belong to the parent, and a child renewing them would keep them alive after
the parent died.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lock import HeldLock


class Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, weakref.ref[HeldLock], int]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, held: HeldLock, delay: float) -> None:
        """Renew ``held`` in ``delay`` seconds, replacing any earlier schedule."""
        with self._cond:
            held._watch_generation += 1
            entry = (
                time.monotonic() + delay,
                next(self._seq),
                weakref.ref(held),
                held._watch_generation,
            )
            heapq.heappush(self._heap, entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="django-dlock-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def cancel(self, held: HeldLock) -> None:
        # Entries are dropped lazily: bumping the generation makes them stale.
        with self._cond:
            held._watch_generation += 1

    def pending(self) -> int:
        """Leases currently scheduled for renewal (stale heap entries excluded)."""
        with self._cond:
            live = 0
            for _, _, ref, generation in self._heap:
                held = ref()
                if held is not None and held._watch_generation == generation:
                    live += 1
            return live

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def _next_due(self) -> HeldLock:
        with self._cond:
            while True:
                if not self._heap:
                    self._cond.wait()
                    continue
                due, _, ref, generation = self._heap[0]
                held = ref()
                if held is None or held._watch_generation != generation:
                    heapq.heappop(self._heap)
                    continue
                delay = due - time.monotonic()
                if delay > 0:
                    del held
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
                return held

    def _run(self) -> None:
        while True:
            held = self._next_due()
            held._renew()
            del held


watchdog = Watchdog()


def _reset_after_fork() -> None:
    global watchdog
    watchdog = Watchdog()


def get_watchdog() -> Watchdog:
    return watchdog


os.register_at_fork(after_in_child=_reset_after_fork)
