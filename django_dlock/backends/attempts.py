"""One acquisition, from its first try to a grant, a timeout or an error: :class:`Attempt`.

``locks[alias].acquire(name)`` makes one :class:`Attempt` and runs it. The
attempt holds everything that acquisition learns while it waits (how often it
was refused, the queue it joined, a lease handed to it), so a backend's
primitives need no per-thread or per-task state: the same object serves the
sync loop and the asyncio one.

A backend writes the primitives; the loop is here, once:

``try_acquire()``
    One atomic attempt: a fencing token, a :class:`~.types.Grant`, or None
    if refused. The default calls the backend's ``do_acquire``.
``wait(remaining)``
    Block until the lock may have become free, at most ``remaining`` seconds
    (None: no deadline). The default backs off, doubling with jitter from
    2 ms to 100 ms; backends that can be woken override it.
``abandon()``
    The acquisition gives up (timeout, error, cancellation): leave any queue
    it joined. The default does nothing.
``release()``
    Release, owner-checked, a lease this attempt may have been granted
    without hearing so (an unknown outcome). The default calls ``do_release``.
``atry_acquire()`` / ``await_(remaining)`` / ``aabandon()`` / ``arelease()``
    The same, awaitable. They are used only by a backend whose
    ``native_async`` is true, which overrides them.
``await_free(remaining)``
    On a backend without ``native_async``: wait on the event loop, with no
    thread, until a release of the name in this process or the backoff's end.
    An attempt class that overrides ``wait()`` but not this one waits by
    blocking (``waits_on_loop`` is then False): an async acquire runs its
    whole loop in a thread of the backend's own (``offload.py``), and a
    cancelled caller's attempt finishes there, whatever it got released.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any, ClassVar

from ..exceptions import BackendUnavailable, LockNotOwned, LockTimeout
from ..held import HeldLock
from ..signals import lock_timeout
from .backoff import backoff, outage_backoff
from .offload import LONG_WAIT, finish
from .types import Grant

if TYPE_CHECKING:
    from .protocol import LeaseOps, LockService

logger = logging.getLogger("django_dlock")

#: An acquire with no timeout that rides out an outage says so this often (seconds).
OUTAGE_LOG_EVERY = 30.0

#: A step of the loop: ("acquire" | "wait" | "abandon" | "release" | "sleep", arguments).
Step = tuple[str, tuple[Any, ...]]


class Attempt:
    """One acquisition of ``name`` by ``owner``; see the module docstring.

    ``holder`` is the holder metadata and its JSON text; ``waits`` counts the
    calls to :meth:`wait` so far (the default backoff's exponent).
    """

    #: Can an async acquisition wait with :meth:`await_free`, on the event
    #: loop (True), or must its waits block a thread (False)? False for a
    #: subclass that overrides ``wait`` and not ``await_free``.
    waits_on_loop: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "wait" in cls.__dict__ and "await_free" not in cls.__dict__:
            cls.waits_on_loop = False
        elif "await_free" in cls.__dict__:
            cls.waits_on_loop = True

    backend: LockService

    def __init__(
        self,
        ops: LeaseOps,
        name: str,
        owner: str,
        ttl: float,
        holder: tuple[dict[str, Any], str],
        renew: bool,
        template: str | None = None,
    ) -> None:
        #: The kind of lease (``ops.py``): every call to the lease goes through it.
        self.ops = ops
        #: The backend itself, never a view of it.
        self.backend = ops.backend
        self.alias = ops.backend.alias
        #: The key template ``name`` was made from, if any (``HeldLock.template``).
        self.template = template
        self.name = name
        self.owner = owner
        self.ttl = ttl
        self.holder = holder
        self.renew = renew
        self.waits = 0
        #: When the acquisition began (``time.monotonic()``), and whether the
        #: lock service has refused it yet: what ``lock_acquired`` reports.
        self.started = time.monotonic()
        self.contended = False
        #: Set when an async caller whose acquisition runs in a worker thread
        #: stops waiting: the loop gives up at its next step (after the wait
        #: under way, which each backend bounds) and leaves any queue.
        self.stopped = False
        #: The event a wait under way blocks on, if it can be set to end it early.
        self.waking: threading.Event | None = None
        #: When the caller's timeout runs out (``time.monotonic()``; None: no
        #: timeout), set when the attempt runs. A backend whose one try may
        #: wait on several servers (Redlock) waits no longer than this, plus
        #: one round trip.
        self.deadline: float | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} on {self.alias!r}>"

    # --- the primitives a backend may override ------------------------------------------

    def try_acquire(self) -> int | Grant | None:
        return self.ops.try_acquire(self.name, self.owner, self.ttl, self.holder[1], self.renew)

    def wait(self, remaining: float | None) -> None:
        """Sleep an exponentially growing, jittered interval, never past the deadline."""
        delay = backoff(self.waits)
        self.waits += 1
        time.sleep(delay if remaining is None else min(delay, remaining))

    def abandon(self) -> None:
        """Leave whatever queue this attempt joined."""

    def stop(self) -> None:
        """Make the loop give up at its next step, cutting short a wait under way."""
        self.stopped = True
        self.interrupt()

    def interrupt(self) -> None:
        """Cut short the wait under way; the default sets ``waking`` if a wait set one.

        A backend whose waits can be long (on a condition, on a watch) wakes
        them here; the default backoff's sleeps are short enough to let run.
        """
        event = self.waking
        if event is not None:
            event.set()

    def release(self) -> bool:
        return self.ops.release(self.name, self.owner)

    async def atry_acquire(self) -> int | Grant | None:
        return await asyncio.to_thread(self.try_acquire)

    async def await_(self, remaining: float | None) -> None:
        await asyncio.to_thread(self.wait, remaining)

    async def aabandon(self) -> None:
        await asyncio.to_thread(self.abandon)

    async def arelease(self) -> bool:
        return await self.ops.arelease(self.name, self.owner)

    async def await_free(self, remaining: float | None) -> None:
        """:meth:`wait` on the event loop: the backoff, cut short by a release here.

        Only the first few waiters of a name in this process poll on the
        backoff; the others wait to be woken (``offload.LocalWakes``).
        """
        delay = backoff(self.waits)
        self.waits += 1
        longest = LONG_WAIT if remaining is None else remaining
        await self.backend.offload.wakes.wait(
            self.name,
            self,
            delay if remaining is None else min(delay, remaining),
            longest,
            self.queued_rank(),
        )

    def queued_rank(self) -> int | None:
        """Where the service queued this waiter, if it keeps a queue (lower: served sooner)."""
        return None

    # --- the loop -----------------------------------------------------------------------

    def run(self, timeout: float | None, deadline: float | None) -> HeldLock:
        """Acquire: one try, then the loop on the sync primitives if it was refused."""
        self.deadline = deadline
        sent = time.monotonic()
        try:
            result = self.try_acquire()
        except BaseException as e:
            # Its outcome is unknown: the loop, at this same attempt, gives it up.
            steps = self._steps(timeout, deadline, refused=False)
            next(steps)
            return self._drive(steps, e)
        if result is not None:  # the uncontended case: no loop to drive
            if not self._arrived_late(result, sent):
                try:
                    return self._handle(result, sent)
                except LockNotOwned:
                    pass  # its short first lease ran out: wait, as in _steps
            else:
                try:
                    self.release()  # as in _steps
                except Exception:
                    logger.debug("Could not release a late grant of %r", self.name)
                # Not refused: the service was too slow (as in _steps).
                steps = self._steps(timeout, deadline, refused=False)
                next(steps)
                return self._drive(steps, self._too_slow())
        self.contended = True
        steps = self._steps(timeout, deadline, refused=True)
        return self._drive(steps, None, next(steps))

    async def arun(self, timeout: float | None, deadline: float | None) -> HeldLock:
        """Acquire on the awaitable primitives (``native_async`` backends)."""
        self.deadline = deadline
        steps = self._steps(timeout, deadline, refused=False)
        primitives: dict[str, Callable[..., Awaitable[Any]]] = {
            "acquire": self.atry_acquire,
            "wait": self.await_,
            "abandon": self.aabandon,
            "release": self.arelease,
            "sleep": asyncio.sleep,
        }
        step: Any
        done, step = False, next(steps)
        while not done:
            kind, args = step
            try:
                result = await primitives[kind](*args)
                if kind in ("acquire", "wait") and _cancelling():
                    # redis-py's asyncio BLPOP can swallow a cancellation
                    # (redis/redis-py#2028): honour it here.
                    raise asyncio.CancelledError
            except BaseException as e:
                done, step = _advance(steps, error=e)
            else:
                done, step = _advance(steps, result)
        held: HeldLock = step
        return held

    async def arun_on_loop(self, timeout: float | None, deadline: float | None) -> HeldLock:
        """Acquire on a thread-based backend, waiting on the event loop.

        The loop is advanced in a thread of the backend's own executors, which
        makes its calls to the service (a try; and a late grant's release, or
        the abandon and release on its way out) until it waits or sleeps, or
        ends (the handle is made there too, as in the sync API: receivers of
        ``lock_acquired`` may use the ORM). Only the waits are on the event
        loop, holding no thread. A call under way when the caller is
        cancelled is finished first, so that the cleanup (release what it
        got, leave the queue) comes after it.
        """
        self.deadline = deadline
        offload = self.backend.offload
        steps = self._steps(timeout, deadline, refused=False)
        work: tuple[str, Callable[[], tuple[bool, Any]]] = (
            "tries",
            functools.partial(self._run_steps, steps, next(steps)),
        )
        offload.wakes.join(self.name, self)
        try:
            while True:
                executor, call = work
                future = offload.submit(executor, call)
                try:
                    done, step = await finish(future)
                except asyncio.CancelledError:
                    if not future.done() or future.cancelled() or future.exception() is not None:
                        raise  # the loop closed, or the attempt ended in an error
                    # The thread's calls were made: go on from where they left the loop.
                    done, step = future.result()
                    if done:
                        offload.submit("ops", step.release_quietly)
                        raise
                    work = (
                        "ops",
                        functools.partial(self._run_steps, steps, error=asyncio.CancelledError()),
                    )
                    continue
                if done:
                    held: HeldLock = step
                    return held
                kind, args = step
                try:
                    if kind == "wait":
                        await self.await_free(*args)
                    else:
                        await asyncio.sleep(*args)
                except BaseException as e:
                    work = ("ops", functools.partial(self._run_steps, steps, error=e))
                else:
                    work = ("tries", functools.partial(self._run_steps, steps))
        finally:
            offload.wakes.leave(self.name, self)

    def _run_steps(
        self,
        steps: Generator[Step, Any, HeldLock],
        step: Step | None = None,
        error: BaseException | None = None,
    ) -> tuple[bool, Any]:
        """In a thread: make the loop's calls to the service until it waits, sleeps or ends.

        From ``step`` if given, else after a wait (or ``error`` thrown in).
        Returns whether the loop ended, and its handle or its next step.
        """
        calls: dict[str, Callable[[], Any]] = {
            "acquire": self.try_acquire,
            "abandon": self.abandon,
            "release": self.release,
        }
        if step is None:
            done, step = _advance(steps, error=error)
        else:
            done = False
        while not done:
            kind = step[0]
            if kind not in calls:
                break
            try:
                result = calls[kind]()
            except BaseException as e:
                done, step = _advance(steps, error=e)
            else:
                done, step = _advance(steps, result)
        return done, step

    def _drive(
        self,
        steps: Generator[Step, Any, HeldLock],
        error: BaseException | None,
        step: Any = None,
    ) -> HeldLock:
        """Run the loop on the sync primitives, from ``step`` or by throwing ``error``."""
        primitives: dict[str, Callable[..., Any]] = {
            "acquire": self.try_acquire,
            "wait": self.wait,
            "abandon": self.abandon,
            "release": self.release,
            "sleep": time.sleep,
        }
        done = False
        if error is not None:
            done, step = _advance(steps, error=error)
        while not done:
            kind, args = step
            try:
                result = primitives[kind](*args)
            except BaseException as e:
                done, step = _advance(steps, error=e)
            else:
                done, step = _advance(steps, result)
        held: HeldLock = step
        return held

    def _steps(
        self, timeout: float | None, deadline: float | None, refused: bool
    ) -> Generator[Step, Any, HeldLock]:
        """The blocking loop of ``acquire()``, without its I/O.

        It yields ``(kind, arguments)`` for each call to the lock service
        ("acquire", "wait" with the seconds left, "abandon", "release") and
        for a pause ("sleep"), and is sent each call's result or thrown its
        exception. :meth:`run` drives it with the sync primitives once its
        first try was refused (``refused``) or failed, and :meth:`arun` with
        the awaitable ones from the start, so both share one loop.

        An outage is ridden out: a :class:`BackendUnavailable` from a call is
        retried after a backoff sleep until the deadline, and then raised
        (not ``LockTimeout``: the caller should learn the service was down),
        unless it is not ``transient`` (a wrong password), which is raised at
        once. ``timeout=0`` has no time to retry in. With no deadline the
        outage is logged as a warning when it starts and every OUTAGE_LOG_EVERY
        seconds while it lasts, so that a waiter hanging on it shows.
        """
        name, alias = self.name, self.alias
        # True while an attempt is out whose outcome we may never learn: sent,
        # then a timeout, a lost connection or a cancelled task. The service
        # may have granted it; nobody would hold that lease until its TTL ran
        # out, so it is released (owner-checked) before the next attempt or on
        # the way out.
        unknown = False
        # The outage being ridden out: its latest error, when it began, how
        # many backoff sleeps it has had, and when it was last logged.
        failure: BackendUnavailable | None = None
        down_since = 0.0
        logged: float | None = None
        retries = 0
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if self.stopped and (refused or failure):
                    # Its async caller stopped waiting (cancelled): give up
                    # now, leaving any queue, instead of waiting on in a thread.
                    raise LockTimeout(
                        f"Stopped acquiring lock {name!r} on backend {alias!r}: the caller "
                        "stopped waiting.",
                        name=name,
                        backend=alias,
                    )
                if remaining is not None and remaining <= 0 and (refused or failure):
                    if failure is None:
                        self._timed_out(timeout)
                        raise LockTimeout(
                            f"Could not acquire lock {name!r} on backend {alias!r} "
                            f"within {timeout:g}s.",
                            name=name,
                            backend=alias,
                        )
                    if not retries:
                        raise failure  # no time to retry in (timeout=0)
                    raise BackendUnavailable(
                        f"{failure} (retried for {time.monotonic() - down_since:.1f}s, until "
                        f"the acquire timeout of {timeout:g}s ran out)",
                        name=failure.name or name,
                        backend=failure.backend or alias,
                    ) from failure
                try:
                    if failure is not None:
                        delay = outage_backoff(retries)
                        yield ("sleep", (delay if remaining is None else min(delay, remaining),))
                        retries += 1
                        if unknown:
                            # The failed attempt may have been granted. Were it
                            # left, the next attempt would wait for our own
                            # lease (the database refuses an owner's second
                            # attempt), so it goes first; if the service is
                            # still down this fails, and is tried again.
                            yield ("abandon", ())
                            yield ("release", ())
                            unknown = False
                    elif refused:
                        yield ("wait", (remaining,))
                    sent = time.monotonic()
                    unknown = True
                    result = yield ("acquire", ())
                    unknown = False
                except BackendUnavailable as e:
                    if not e.transient:
                        raise
                    now = time.monotonic()
                    if failure is None:
                        down_since = now
                    if deadline is None and (logged is None or now - logged >= OUTAGE_LOG_EVERY):
                        logged = now
                        logger.warning(
                            "Lock backend %r unavailable for %.0fs while acquiring %r; "
                            "retrying until it answers (no timeout): %s",
                            alias,
                            now - down_since,
                            name,
                            e,
                        )
                    failure = e
                    continue
                if result is not None and self._arrived_late(result, sent):
                    # Granted, but the reply came after the lease ran out by
                    # our clock: someone else may hold the lock by now. Give
                    # it back (owner-checked).
                    try:
                        yield ("release", ())
                    except Exception:
                        logger.debug("Could not release a late grant of %r", name)
                    # Nobody refused it: the service (or the network) is too
                    # slow for this TTL. Ride it out as an outage, and say so
                    # if the timeout runs out (not LockTimeout: the lock may
                    # be free, and a caller that skips work when it is held
                    # would skip it for nothing).
                    result = None
                    if failure is None:
                        down_since = time.monotonic()
                    failure = self._too_slow()
                    continue
                if failure is not None:
                    if logged is not None:
                        logger.info(
                            "Lock backend %r answers again after %.1fs; acquiring %r goes on",
                            alias,
                            time.monotonic() - down_since,
                            name,
                        )
                    failure, retries, logged = None, 0, None
                if result is not None:
                    try:
                        held = self._handle(result, sent)
                    except LockNotOwned:
                        # A short first lease (a hand-over) ran out before it
                        # could be extended to the TTL: not ours after all, so
                        # wait again (the holder that follows counts as
                        # refusing us).
                        result = None
                        refused = self.contended = True
                        continue
                    break
                refused = self.contended = True
        except BaseException as e:
            # An error that says the attempt took no effect is not unknown.
            # Nor is one the service refuses every time (a wrong password,
            # a TTL out of range): it was refused, not lost on the way.
            known = getattr(e, "outcome_known", False) or getattr(e, "transient", True) is False
            unknown = unknown and not known
            for step, needed in (("abandon", refused or unknown), ("release", unknown)):
                if not needed:
                    continue
                try:
                    yield (step, ())
                except Exception:
                    # The lease or queue entry expires on its own; the caller's
                    # error matters more.
                    logger.warning("Could not %s the attempt on %r on %r", step, name, alias)
            raise
        return held

    def _timed_out(self, timeout: float | None) -> None:
        """Send ``lock_timeout``: the deadline passed with the lock held by others."""
        if lock_timeout.receivers:
            lock_timeout.send(
                sender=type(self.backend),
                backend=self.alias,
                name=self.name,
                timeout=timeout,
                waited=time.monotonic() - self.started,
                template=self.template,
            )

    def _too_slow(self) -> BackendUnavailable:
        """The error for a grant that came back after its lease had run out."""
        error = BackendUnavailable(
            f"A grant of lock {self.name!r} on backend {self.alias!r} came back after its "
            f"lease of {self.ttl:g}s had run out: the lock service or the network is too slow "
            "for this TTL.",
            name=self.name,
            backend=self.alias,
        )
        error.outcome_known = True  # type: ignore[attr-defined]  # released: nothing to undo
        return error

    def _arrived_late(self, result: int | Grant, sent: float) -> bool:
        """Did the grant's reply come after its lease had run out by our clock?

        A reply held up by the network longer than the TTL (the chaos run's
        black hole) grants a lease that is gone: handing it to the caller
        would let two holders believe they hold the lock.
        """
        if isinstance(result, Grant):
            expires, lease = result.expires, result.lease
        else:
            expires, lease = sent + self.ttl, self.ttl
        if expires - self.backend.drift(lease) > time.monotonic():
            return False
        logger.warning(
            "A grant of %r on %r came back after its lease had run out; trying again",
            self.name,
            self.alias,
        )
        return True

    def _handle(self, result: int | Grant, sent: float) -> HeldLock:
        """The handle for a granted try sent at ``sent``."""
        if isinstance(result, Grant):
            token, expires, lease = result.token, result.expires, result.lease
        else:
            token, expires, lease = result, sent + self.ttl, self.ttl
        return HeldLock(
            self.backend, self.ops, self.name, self.owner, token,
            ttl=self.ttl, expires=expires, lease=lease, holder=self.holder[0], renew=self.renew,
            waited=time.monotonic() - self.started, contended=self.contended,
            template=self.template,
        )  # fmt: skip


def _cancelling() -> bool:
    """Whether the current task has a cancellation pending (Python 3.11+; else False)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


def _advance(
    steps: Generator[Any, Any, Any], result: Any = None, error: BaseException | None = None
) -> tuple[bool, Any]:
    """Send ``result`` (or throw ``error``) into ``steps``: (finished, its value or next step)."""
    try:
        return False, (steps.throw(error) if error is not None else steps.send(result))
    except StopIteration as finished:
        return True, finished.value
