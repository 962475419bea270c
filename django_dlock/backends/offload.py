"""Where the async API of a thread-based backend runs its blocking calls.

A backend without native async primitives (the database, locmem, etcd, a
Redis Cluster, Redlock, django-redis) talks to its service with blocking
calls, so an async caller runs them in threads. Which threads matters:

    t0  8 tasks wait for a lock, each in a thread of the event loop's default
        executor; its threads are all taken.
    t1  The holder leaves its ``async with``: its release is queued on the
        same executor, behind the waiters.
    t2  The lease runs out (the TTL): a waiter gets the lock, and the holder's
        release, run at last, finds it gone and raises ``LockNotOwned``.

So each backend has executors of its own, apart from the loop's default one
(:class:`Offload`):

``ops``
    Releases, extends, checks and the abandons of attempts that give up:
    short calls, never queued behind a wait.
``tries``
    The single tries of an acquisition that waits on the event loop.
``waits``
    An acquisition whose backend can only wait by blocking (a condition, a
    BLPOP, a watch) runs its loop here, one thread per waiting acquisition
    (threads are reused once idle), up to :data:`WAIT_THREADS`.

An acquisition on a backend whose waits are a backoff (the database) waits on
the event loop itself, with no thread: its tries go to ``tries``, and between
them it sleeps, or is woken at once by a release of the same name in this
process (:class:`LocalWakes`), which hands the lock to the next local waiter
without waiting for its backoff to end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import heapq
import itertools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Releasable(Protocol):
    """A handle an abandoned async acquisition releases (``HeldLock``)."""

    def release_quietly(self) -> bool: ...


R = TypeVar("R", bound=Releasable)

#: Threads per backend for releases, extends, checks and abandons. (On the
#: database backend each thread has a connection of its own while it has work;
#: see :meth:`Offload.submit`.)
OPS_THREADS = 4
#: Threads per backend for the tries of acquisitions that wait on the event loop.
TRY_THREADS = 2
#: How many of a process's async waiters of one name poll the service on
#: their backoff; the others wait for a release here (or a waiter ahead of
#: them to leave), re-checking every LONG_WAIT seconds only.
POLLERS = 2
#: The longest wait of an async waiter that does not poll, in seconds.
LONG_WAIT = 1.0
#: Most acquisitions of one backend blocking in threads at once; beyond it,
#: an acquisition waits for a thread (releases do not: they have their own).
WAIT_THREADS = 1000

_offloads: weakref.WeakSet[Offload] = weakref.WeakSet()


class Offload:
    """One backend's executors (made on first use) and its waiters' wake-ups."""

    def __init__(self, alias: str, *, close_connections: bool = False) -> None:
        self.alias = alias
        self.close_connections = close_connections
        self._mutex = threading.Lock()
        self._executors: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self.wakes = LocalWakes()
        _offloads.add(self)

    def executor(self, kind: str) -> concurrent.futures.ThreadPoolExecutor:
        """The ``ops``, ``tries`` or ``waits`` executor."""
        found = self._executors.get(kind)
        if found is None:
            with self._mutex:
                found = self._executors.get(kind)
                if found is None:
                    size = {"ops": OPS_THREADS, "tries": TRY_THREADS, "waits": WAIT_THREADS}[kind]
                    found = self._executors[kind] = concurrent.futures.ThreadPoolExecutor(
                        size, thread_name_prefix=f"django-dlock-{self.alias}-{kind}"
                    )
        return found

    def submit(
        self, kind: str, func: Callable[..., T], *args: Any
    ) -> concurrent.futures.Future[T]:
        """Run ``func(*args)`` on executor ``kind`` in a copy of the current context.

        For a backend on Django's connections (``close_connections``), a
        thread that has no more work queued closes its connections after the
        call: these threads outlive requests and tests, and a connection they
        kept would stay idle on the server for the life of the process (and
        stop ``manage.py test`` from dropping its test database). Under load
        the next call reuses the connection.
        """
        executor = self.executor(kind)
        if self.close_connections:
            return executor.submit(
                contextvars.copy_context().run, _closing_when_idle, executor, func, *args
            )
        return executor.submit(contextvars.copy_context().run, func, *args)

    def _after_fork(self) -> None:
        # The parent's worker threads do not exist here: new executors on first use.
        self._mutex = threading.Lock()
        self._executors = {}
        self.wakes = LocalWakes()


def _closing_when_idle(
    executor: concurrent.futures.ThreadPoolExecutor, func: Callable[..., T], *args: Any
) -> T:
    try:
        return func(*args)
    finally:
        if executor._work_queue.empty():
            from django.db import connections

            for connection in connections.all(initialized_only=True):
                connection.close()


def _after_fork_in_child() -> None:
    for offload in list(_offloads):
        offload._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


async def finish(future: concurrent.futures.Future[T]) -> T:
    """Await a call already running in a thread to its end, even if cancelled meanwhile.

    A cancellation is raised once the call is over, so that what the caller
    does next (release what a try may have got, leave the queue) comes after
    the call's own effect, never before it.
    """
    wrapped = asyncio.wrap_future(future)
    cancelled = False
    while not wrapped.done():
        try:
            await asyncio.shield(wrapped)
        except asyncio.CancelledError:
            if wrapped.done() and wrapped.cancelled():
                raise  # the loop closed under it
            cancelled = True
    result = wrapped.result()
    if cancelled:
        raise asyncio.CancelledError
    return result


class _Name:
    __slots__ = ("members", "pending", "waiting")

    def __init__(self) -> None:
        # The acquisitions waiting for the name, each with its rank.
        self.members: dict[object, tuple[int, int]] = {}
        # Those waiting right now: (rank, loop, future).
        self.waiting: list[tuple[tuple[int, int], asyncio.AbstractEventLoop, Any]] = []
        self.pending = False


class LocalWakes:
    """This process's async waiters of each name, woken one at a time by a release here.

    A waiter joins when its acquisition begins and leaves when it ends. A
    release of the name through this process wakes the waiter that has been
    waiting longest (or, if none is waiting right now, lets the next one to
    wait try again at once). A release by another process is seen at the
    next try of one of the first POLLERS waiters, after its backoff: the
    others do not poll (a hundred waiters polling a database every 100 ms
    would make a thousand statements a second to learn what one learns).
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._names: dict[str, _Name] = {}
        self._joined = itertools.count()

    def join(self, name: str, member: object) -> None:
        """``member`` waits for ``name`` from now on; ranked by when it joined."""
        with self._mutex:
            entry = self._names.get(name)
            if entry is None:
                entry = self._names[name] = _Name()
            entry.members[member] = (1, next(self._joined))

    def leave(self, name: str, member: object) -> None:
        with self._mutex:
            entry = self._names.get(name)
            if entry is None:
                return
            entry.members.pop(member, None)
            if not entry.members:
                del self._names[name]
                return
        # It may have been the one woken, or a poller: the next one tries now.
        self.wake(name)

    def wake(self, name: str) -> None:
        """A release of ``name`` here: wake one waiter of it."""
        if not self._names:
            return
        with self._mutex:
            entry = self._names.get(name)
            if entry is None:
                return
            entry.waiting = [w for w in entry.waiting if not w[2].done()]
            if not entry.waiting:
                entry.pending = True
                return
            first = min(range(len(entry.waiting)), key=lambda i: entry.waiting[i][0])
            _, loop, future = entry.waiting.pop(first)
        with contextlib.suppress(RuntimeError):  # its loop closed: the waiter is gone
            loop.call_soon_threadsafe(_set, future)

    async def wait(
        self,
        name: str,
        member: object,
        backoff: float,
        longest: float,
        queued: int | None = None,
    ) -> None:
        """Until a release of ``name`` here wakes ``member``, or its time is up.

        That is ``backoff`` seconds for one of the POLLERS first members,
        else ``longest`` (at most LONG_WAIT). Members are ranked by when they
        joined, except that one ``queued`` on the service (a fair Redis's
        queue: the server's clock when it joined it, which orders the queue)
        ranks before all that are not: a release wakes, and the polling is
        done by, those the service will grant first.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._mutex:
            entry = self._names.get(name)
            if entry is None:
                return
            if entry.pending:
                entry.pending = False
                return
            rank = entry.members.get(member, (1, 0))
            if queued is not None:
                rank = entry.members[member] = (0, queued)
            first = heapq.nsmallest(POLLERS, entry.members.values())
            polls = rank <= first[-1]
            entry.waiting.append((rank, loop, future))
        timeout = backoff if polls else max(backoff, min(longest, LONG_WAIT))
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if not future.done():
                future.cancel()


def _set(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Handoff:
    """Between an async acquire's worker thread and a caller that may stop waiting.

    Either the thread delivers the handle before the caller abandons it (then
    the caller's side releases it once the thread's result arrives), or the
    caller abandons first (then the thread releases what it gets).
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._abandoned = False
        self._delivered = False

    def deliver(self, held: R) -> R:
        with self._mutex:
            self._delivered = not self._abandoned
        if not self._delivered:
            held.release_quietly()
        return held

    def abandon(self) -> bool:
        """Mark the result unwanted; True if it was delivered already (the caller releases)."""
        with self._mutex:
            self._abandoned = True
            return self._delivered


def retrieve_outcome(acquiring: asyncio.Future[Any]) -> None:
    """Take the thread's exception, if any, so asyncio does not report it as unseen."""
    if not acquiring.cancelled():
        acquiring.exception()


def release_unwanted(acquiring: asyncio.Future[Any]) -> None:
    """Release a delivered handle whose caller stopped waiting (off the event loop)."""
    if acquiring.cancelled() or acquiring.exception() is not None:
        return
    held: Releasable = acquiring.result()
    threading.Thread(
        target=held.release_quietly, name="django-dlock-unwanted", daemon=True
    ).start()
