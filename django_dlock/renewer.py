"""The renewal thread of each backend alias (:class:`Renewer`).

The watchdog thread (``watchdog.py``) only schedules; the calls that renew
leases run here, one thread per backend alias. A renewal thread that falls
behind reports it once per episode and leaves a note that ``locks check``
reads (``lag.py``).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .backends.types import BoundElsewhere
from .clocks import ClockProbe
from .dispatch import get_dispatcher, mark_lease_thread, send_robust
from .lag import LAG_NOTE_TTL, leave_note
from .signals import watchdog_lagging

if TYPE_CHECKING:
    # The sides of the backend, the handle and the watchdog that the renewal
    # thread uses (backends/protocol.py), named as what they are.
    from .backends.protocol import Renewable as HeldLock
    from .backends.protocol import Scheduler as Watchdog

logger = logging.getLogger("django_dlock")

#: Most leases a renewal thread takes from its queue at a time (earliest-expiring first).
ROUND = 2000
#: A renewal sent more than this share of its TTL after it was due is late:
#: the watchdog is lagging. Normally one is sent within milliseconds.
LATE_SHARE = 1 / 6
#: A lag episode ends after this many seconds without a late renewal.
LAG_QUIET = 60.0


class Renewer:
    """One thread per backend alias that makes that backend's renewal calls.

    The watchdog thread only schedules; the calls to a lock service run here,
    so a slow or unreachable service delays only its own backend's renewals.
    Due handles wait in a queue ordered by when their leases run out, and the
    thread renews them in batches (``do_extend_many``, up to the backend's
    ``renew_batch`` leases a call), earliest-expiring first: when renewals
    come due faster than the service answers, the leases closest to their end
    go first, and a lease that runs out before its turn, or would before its
    renewal could come back, is marked lost (and costs no call), so that as
    few leases as possible are lost. A lease whose
    renewal has not come back by the time it runs out (a server that accepts
    and never answers) is marked lost then, from the watchdog's thread.

    Sending renewals more than a sixth of their TTL late is a lag: it is
    reported once per episode (:meth:`_report_lag`). The thread also runs
    one-off work (:meth:`submit`), and ends after IDLE seconds without work.
    """

    IDLE = 30.0

    def __init__(self, watchdog: Watchdog, alias: str) -> None:
        self.alias = alias
        self._watchdog = watchdog
        self._cond = threading.Condition(threading.Lock())
        self._work: deque[Callable[[], object]] = deque()
        # Only the watchdog thread adds here; flush() moves them to _queue.
        self._added: list[tuple[HeldLock, float]] = []
        # (lease ends, seq, handle, renewal due): a heap, earliest end first.
        self._queue: list[tuple[float, int, HeldLock, float]] = []
        self._seq = itertools.count()
        self._sending: list[HeldLock] = []
        # How long a recent call took, seconds (a moving average): a lease with
        # less than twice that left (and under a sixth of its TTL) would run out
        # before its renewal came back.
        self._round_trip = 0.0
        self._judge_at = math.inf
        self._thread: threading.Thread | None = None
        #: Seconds late of the latest late renewal while lagging, else None.
        self.lag: float | None = None
        #: When the latest late renewal was sent (``time.monotonic()``).
        self.last_late = -math.inf
        self._note_owner: str | None = None
        self._noted_at = -math.inf
        # Leases the judge found run out while they waited, not yet reported.
        self._missed = 0
        self._missed_sample: list[HeldLock] = []
        #: Reads the backend's clock while it has leases here (``clocks.py``).
        self.clock = ClockProbe(
            alias,
            functools.partial(watchdog.scheduled, alias),
            functools.partial(watchdog.schedule, delay=0.0),
            _close_thread_connections,
        )

    def submit(self, work: Callable[[], object]) -> None:
        """Run ``work`` on this thread (one-off calls to the service: a delayed release)."""
        with self._cond:
            self._work.append(work)
            self._start()
            self._cond.notify()

    def add(self, held: HeldLock, due: float) -> None:
        """Renew ``held`` (due at ``due``) at the next :meth:`flush`; watchdog thread only."""
        self._added.append((held, due))

    def flush(self) -> None:
        """Queue what :meth:`add` collected and wake the thread; watchdog thread only."""
        if not self._added:
            return
        added, self._added = self._added, []
        with self._cond:
            for held, due in added:
                heapq.heappush(self._queue, (held.expires_at, next(self._seq), held, due))
            self._start()
            self._cond.notify()
            self._judge_before(self._queue[0][0])

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"django-dlock-renew-{self.alias}", daemon=True
            )
            self._thread.start()

    def _judge_before(self, expires: float) -> None:
        """Have the watchdog judge the queue when a lease in it or in flight runs out."""
        if expires < self._judge_at:
            self._judge_at = expires
            self._watchdog.call_at(expires, self._judge)

    def judge_by(self, held: HeldLock, expires: float) -> None:
        """``held``, queued or in flight, now runs out sooner, at ``expires``: judge it then.

        (The queue is ordered by when leases ran out as they were queued.)
        """
        ref = weakref.ref(held)  # a forgotten handle is not kept alive by this
        self._watchdog.call_at(expires, lambda: self._judge_one(ref()))

    def _judge_one(self, held: HeldLock | None) -> None:
        if held is not None and held.renewing and held.expires_at <= time.monotonic():
            _quietly(held.renewal_lost, "its renewal did not come back before the lease ran out")

    def _judge(self) -> None:
        """On the watchdog's thread: mark lost the leases that ran out waiting or in flight."""
        now = time.monotonic()
        waited: list[HeldLock] = []
        ran_out: list[HeldLock] = []
        with self._cond:
            self._judge_at = math.inf
            while self._queue and self._queue[0][0] <= now:
                _, seq, held, due = heapq.heappop(self._queue)
                if held.expires_at > now:  # extended by hand while it waited
                    heapq.heappush(self._queue, (held.expires_at, seq, held, due))
                elif held.renewal_wanted():
                    waited.append(held)
            if waited:
                self._missed += len(waited)
                self._missed_sample = waited[:1]
                self._cond.notify()  # the renewal thread reports it
            next_end = self._queue[0][0] if self._queue else math.inf
            for held in self._sending:
                if held.expires_at <= now:
                    ran_out.append(held)
                elif held.renewing:
                    next_end = min(next_end, held.expires_at)
            if next_end < math.inf:
                self._judge_before(next_end)
        for held in waited:
            _quietly(held.renewal_lost, WAITED)
        for held in ran_out:
            _quietly(held.renewal_lost, "its renewal did not come back before the lease ran out")

    def _run(self) -> None:
        mark_lease_thread()
        while True:
            if not self._work and not self._queue:
                # No database connection is kept between rounds: one left open
                # on a test database stops `manage.py test` from dropping it.
                _close_thread_connections()
            with self._cond:
                while not self._work and not self._queue and not self._missed:
                    if not self._cond.wait(self.IDLE) and not self._work and not self._queue:
                        self._thread = None  # the next submit() or flush() starts another
                        break
                if self._thread is None:
                    work = None
                else:
                    work = self._work.popleft() if self._work else None
                    if work is None:
                        batch, ran_out, late = self._take()
                        missed, self._missed = self._missed, 0
                        sample, self._missed_sample = self._missed_sample, []
            if self._thread is not threading.current_thread():
                _close_thread_connections()
                return
            if work is not None:
                _quietly(work)
                del work
                continue
            too_late: list[HeldLock] = []
            try:
                too_late = self._send(batch)
            except BaseException:
                # Even SystemExit from a signal receiver: this thread serves
                # every lease of the alias and must not end with work queued.
                logger.exception("Renewing leases on %r failed", self.alias)
            # Those that ran out are told after the round is sent: their
            # lock_lost receivers must not hold up the leases still alive.
            for held in ran_out + too_late:
                _quietly(held.renewal_lost, WAITED)
            # After the round is sent: a slow receiver must not hold it up.
            lost = len(ran_out) + len(too_late) + missed
            _quietly(self._lag_state, late, lost, batch or ran_out or sample)
            with self._cond:
                self._sending = []
            del batch, ran_out

    def _take(self) -> tuple[list[HeldLock], list[HeldLock], float]:
        """Under the lock: the next round, earliest end first; those that ran out; lateness."""
        now = time.monotonic()
        batch: list[HeldLock] = []
        ran_out: list[HeldLock] = []
        late = 0.0
        while self._queue and len(batch) < ROUND:
            _, _, held, due = heapq.heappop(self._queue)
            if not held.renewal_wanted():
                continue
            if held.expires_at <= now:
                ran_out.append(held)
                continue
            if now - due > held.ttl * LATE_SHARE:
                late = max(late, now - due)
            batch.append(held)
        self._sending = batch
        if batch:
            self._judge_before(min(held.expires_at for held in batch))
        return batch, ran_out, late

    def _send(self, batch: list[HeldLock]) -> list[HeldLock]:
        """Renew ``batch``, a call per chunk; return the leases given up as too late.

        Under overload the earliest-expiring leases are the ones closest to
        their end. One that would run out before its renewal could come back
        (less than twice a recent call's time left, and less than a sixth of
        its TTL) is given up rather than sent: it would be lost anyway, and
        the call's time goes to the leases that can still be saved.
        """
        too_late: list[HeldLock] = []
        groups: dict[Any, list[HeldLock]] = {}
        for held in batch:
            groups.setdefault(held.ops.renewal_key, []).append(held)
        for group in groups.values():
            ops = group[0].ops
            self.clock.start(group[0].backend)
            size = max(1, group[0].backend.renew_batch)
            for start in range(0, len(group), size):
                chunk = group[start : start + size]
                chunk, requests = self._begin(chunk, too_late)
                if not chunk:
                    continue
                leases = [
                    (held.name, held.owner, request.ttl)
                    for held, request in zip(chunk, requests, strict=True)
                ]
                try:
                    results = ops.extend_many(leases)
                except Exception as e:
                    results = [e] * len(chunk)
                self._end(chunk, requests, results)
        return too_late

    def _begin(
        self, chunk: list[HeldLock], too_late: list[HeldLock]
    ) -> tuple[list[HeldLock], list[Any]]:
        """Before a call: leases it cannot save go to ``too_late``; the rest are recorded sent."""
        sent = time.monotonic()
        margin = 2 * self._round_trip
        if chunk[0].expires_at - sent <= margin:  # the first ends first
            given_up = [
                held
                for held in chunk
                if held.expires_at - sent <= min(margin, held.ttl * LATE_SHARE)
            ]
            if given_up:
                gone = set(given_up)
                chunk = [held for held in chunk if held not in gone]
                too_late += given_up
        # Each reply is applied with the TTL sent and counted from its send.
        return chunk, [held.renewal_sending() for held in chunk]

    def leases(self) -> list[HeldLock]:
        """The leases handed to this renewer (added, queued or in flight) still held here."""
        with self._cond:
            handed = [
                *(held for held, _ in self._added),
                *(entry[2] for entry in self._queue),
                *self._sending,
            ]
        # A released one stays queued until its turn comes: it holds nothing.
        return [held for held in handed if not (held.released or held.detached)]

    def _end(self, chunk: list[HeldLock], requests: list[Any], results: list[Any]) -> None:
        """After a call: apply each reply to its handle."""
        if requests:
            took = time.monotonic() - requests[0].sent
            self._round_trip = 0.8 * self._round_trip + 0.2 * took
        failed = None
        for held, request, result in zip(chunk, requests, results, strict=True):
            if _quietly(held.renewal_done, request, result) is not None and not isinstance(
                result,
                BoundElsewhere,  # put off until its transaction ends: not a failure
            ):
                failed = result
        if failed is not None:
            logger.warning(
                "Renewing %d lease(s) on %r failed, retrying: %r",
                sum(isinstance(r, Exception) for r in results),
                self.alias,
                failed,
            )

    def _lag_state(self, late: float, ran_out: int, sample: list[HeldLock]) -> None:
        now = time.monotonic()
        if late or ran_out:
            quiet = now - self.last_late > LAG_QUIET
            self.last_late = now
            if self.lag is None or quiet:
                self.lag = late
                self._report_lag(late, ran_out, sample[0])
            else:
                self.lag = max(self.lag, late)
                if now - self._noted_at > LAG_NOTE_TTL / 2:  # still lagging: keep the note
                    self._leave_note_later(sample[0], late, ran_out)
        elif self.lag is not None and now - self.last_late > LAG_QUIET and not self._queue:
            self.lag = None
            logger.info("The watchdog caught up with its renewals on %r", self.alias)

    def _report_lag(self, late: float, ran_out: int, held: HeldLock) -> None:
        """Once per episode: a log line, ``watchdog_lagging``, and a note for ``locks check``."""
        waiting = len(self._queue)
        backend = held.backend
        logger.warning(
            "The django-dlock watchdog is falling behind on backend %r: renewals are "
            "going out %.1f s late, %d lease(s) wait and %d ran out first. The leases "
            "closest to their end are renewed first. Either the process was paused, a "
            "renewal was held up by the lock service (a slow server or network; on SQLite, "
            "a transaction holding the database's write lock), or it holds more leases "
            "than it can renew in time: hold fewer leases per process, or give them "
            "longer TTLs.",
            self.alias,
            late,
            waiting,
            ran_out,
        )
        # Sent from the alias's signal thread (dispatch.py), not this one.
        get_dispatcher().deliver(
            self.alias,
            None,
            "watchdog_lagging",
            functools.partial(
                send_robust,
                watchdog_lagging,
                "watchdog_lagging",
                sender=type(backend),
                backend=self.alias,
                late=late,
                waiting=waiting,
                lost=ran_out,
            ),
        )
        self._leave_note_later(held, late, ran_out)

    def _leave_note_later(self, held: HeldLock, late: float, ran_out: int) -> None:
        """Leave (or renew) the note for ``locks check`` from a thread of its own."""
        self._noted_at = time.monotonic()
        backend = held.backend
        detail = {"late_s": round(late, 3), "waiting": len(self._queue), "ran_out": ran_out}
        threading.Thread(
            target=self._leave_note, args=(backend, detail), name="django-dlock-lag", daemon=True
        ).start()

    def _leave_note(self, backend: Any, detail: dict[str, Any]) -> None:
        """A lease named after this process, which ``locks check`` lists: it lagged."""
        try:
            self._note_owner = leave_note(backend, self.alias, self._note_owner, detail)
        finally:
            _close_thread_connections()


WAITED = (
    "its renewal could not be sent before the lease ran out (the watchdog fell behind: "
    "the process was paused, or the renewals before it were held up)"
)


def _quietly(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; a BaseException (a receiver's SystemExit) is logged, not raised."""
    try:
        return fn(*args)
    except BaseException:
        logger.exception("A step of a renewal thread failed (a signal receiver raised?)")
        return None


def _close_thread_connections() -> None:
    """Close the Django database connections this thread opened (the database backend's)."""
    try:
        from django.db import connections
    except ImportError:  # pragma: no cover - Django is a dependency
        return
    for connection in connections.all(initialized_only=True):
        connection.close()
