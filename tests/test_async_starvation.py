"""Async waiters on thread-based backends never hold up the holder's release (issue 27, #5, #6).

Before: a waiting async acquisition ran its whole wait in a thread of the
event loop's default executor, and ``arelease()`` queued its release on the
same executor. With the executor's threads all taken by waiters, the holder's
release waited until its lease ran out: each hand-over took a whole TTL, the
holder got ``LockNotOwned`` on leaving, and with ``timeout=None`` nobody got
in at all (an etcd semaphore). A cancelled ``arelease()`` whose thread had not
started yet was dropped, leaving the lease held by nobody until its TTL.

Nothing here asserts a duration; benchmarks/async_handover.py measures them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from django_dlock import lock, rwlock, semaphore
from django_dlock.backends.base import BaseLockBackend
from django_dlock.lock import Lock

#: A TTL short enough that a release held up until expiry shows as LockNotOwned.
SHORT_TTL = 1.0
#: Generous: every waiter must get in well before it.
TIMEOUT = 60.0

KINDS = ["mutex", "semaphore", "rwlock-write"]


def _make(kind: str, backend: BaseLockBackend) -> Callable[..., Lock]:
    if kind != "mutex" and not backend.supports_semaphores:
        pytest.skip(f"backend {backend.alias!r} declares no supports_semaphores")
    if kind == "mutex":
        return lambda name, **kw: lock(name, backend=backend.alias, **kw)
    if kind == "semaphore":
        return lambda name, **kw: semaphore(name, limit=2, backend=backend.alias, **kw)
    return lambda name, **kw: rwlock(name, backend=backend.alias, **kw).write()


async def _serve(
    make: Callable[..., Lock],
    name: str,
    waiters: int,
    *,
    ttl: float,
    hold: float,
    limit: int,
    timeout: float | None = TIMEOUT,
    stagger: float = 0.0,
) -> tuple[list[int], list[BaseException], int]:
    """``waiters`` tasks enter ``name`` once each, holding ``hold`` seconds.

    Returns who entered in which order, the errors the waiters raised
    (``LockNotOwned`` on leaving, ``LockTimeout``), and the most inside at once.
    """
    order: list[int] = []
    errors: list[BaseException] = []
    inside = [0, 0]  # now, most

    async def waiter(index: int) -> None:
        try:
            async with make(name, ttl=ttl, timeout=timeout, metadata={"waiter": index}):
                inside[0] += 1
                inside[1] = max(inside)
                order.append(index)
                await asyncio.sleep(hold)
                inside[0] -= 1
        except Exception as e:
            errors.append(e)

    tasks = []
    for index in range(waiters):
        tasks.append(asyncio.create_task(waiter(index)))
        await asyncio.sleep(stagger)
    # A bound on the whole run, so that a regression fails instead of hanging.
    bound = (timeout or TIMEOUT) + waiters * (hold + ttl) + 30
    _, pending = await asyncio.wait(tasks, timeout=bound)
    for task in pending:
        task.cancel()
    if pending:
        errors.append(AssertionError(f"{len(pending)} waiters still waiting after {bound:g}s"))
    return order, errors, inside[1]


@pytest.mark.parametrize("kind", KINDS)
def test_waiters_filling_the_default_executor_do_not_starve_the_release(
    backend_alias: str, backend: BaseLockBackend, name: str, kind: str
) -> None:
    """8 waiters, a default executor of 2 threads: each holder's release still goes out.

    On a893e4f: the waiters held both threads of the default executor, each
    holder's release waited behind them until its lease ran out, and leaving
    the block raised LockNotOwned (etcd semaphore: nobody got in).
    """
    make = _make(kind, backend)
    limit = 2 if kind == "semaphore" else 1
    # 3 s: the regression held each release until its lease ran out, behind
    # waiters that hold the threads for up to their 20 s timeout, so it still
    # fails; 1 s leases ran out under load (4 xdist workers on 2 cores) on the
    # database backends with the release already sent.
    ttl = max(3.0, backend.min_ttl)

    async def scenario() -> tuple[list[int], list[BaseException], int]:
        executor = ThreadPoolExecutor(2, thread_name_prefix="django-dlock-test-default")
        asyncio.get_running_loop().set_default_executor(executor)
        return await _serve(make, name, 8, ttl=ttl, hold=0.05, limit=limit, timeout=20)

    order, errors, most = asyncio.run(scenario())
    assert errors == [], [f"{type(e).__name__}: {e}" for e in errors]
    assert sorted(order) == list(range(8))
    assert most <= limit


@pytest.mark.parametrize("kind", KINDS)
def test_thirty_async_waiters_are_all_served(
    backend_alias: str, backend: BaseLockBackend, name: str, kind: str
) -> None:
    """30 waiters with a 10 ms hold and a generous timeout: all get in, none errs.

    Where the backend serves waiters in arrival order (etcd; a fair Redis),
    they enter in the order they queued on the server. On etcd that is the
    order of their keys' create revisions, which need not be the order they
    started in: an etcd waiter's first try runs in a thread and grants its
    lease before it puts its key, and on a loaded machine a waiter started
    50 ms later can get there first (seen: 1 to 3 of 6 runs).
    """
    make = _make(kind, backend)
    limit = 2 if kind == "semaphore" else 1
    fair = backend.supports_fair_semaphores if kind != "mutex" else backend.supports_fair
    ttl = max(5.0, backend.min_ttl)

    async def scenario() -> tuple[list[int], list[BaseException], int]:
        first = await make(name, ttl=ttl).aacquire_handle()
        if limit == 2:
            second = await make(name, ttl=ttl).aacquire_handle()
        # Started one by one, so that each is waiting before the next starts.
        run = asyncio.create_task(
            _serve(make, name, 30, ttl=ttl, hold=0.01, limit=limit, stagger=0.05)
        )
        await asyncio.sleep(30 * 0.05 + 0.2)
        if fair and limit == 1 and backend_alias.startswith("etcd"):
            queued.extend(_queued_on_etcd(backend, name))
        await first.arelease()
        if limit == 2:
            await second.arelease()
        return await run

    queued: list[int] = []
    order, errors, most = asyncio.run(scenario())
    assert errors == [], [f"{type(e).__name__}: {e}" for e in errors]
    assert sorted(order) == list(range(30))
    assert most <= limit
    if fair and limit == 1:
        # Redis queues a waiter from the event loop, in its first try:
        # before the next waiter starts.
        arrived = queued if backend_alias.startswith("etcd") else list(range(30))
        assert sorted(arrived) == list(range(30))  # all had queued: the holder's key aside
        assert order == arrived


def _queued_on_etcd(backend: BaseLockBackend, name: str) -> list[int]:
    """The waiters queued on ``name``, in the order of their keys' create revisions.

    A mutex's key holds the holder's JSON; a read/write lock's, a dict with it.
    """
    from django_dlock.backends.etcd import EtcdBackend
    from django_dlock.backends.etcd import etcdrpc as rpc
    from django_dlock.backends.etcd.transport import escape, range_end

    assert isinstance(backend, EtcdBackend)
    state = backend.state
    found: list[tuple[int, int]] = []
    for root in ("dlock/", "dlock-slots/"):
        start = f"{backend.key_prefix}{root}".encode() + escape(name) + b"/"
        reply = state.call(
            name, "kv", "Range", rpc.RangeRequest(key=start, range_end=range_end(start))
        )
        for kv in reply.kvs:
            value = json.loads(kv.value)
            holder = value.get("holder", value) if root == "dlock-slots/" else value
            holder = json.loads(holder) if isinstance(holder, str) else holder
            if "waiter" in holder:
                found.append((kv.create_revision, holder["waiter"]))
    return [waiter for _, waiter in sorted(found)]


def _block_release_threads(backend: BaseLockBackend, gate: threading.Event) -> list[Any]:
    """Occupy every thread a release may run in (the default executor's, the backend's own).

    A release queued there does not start until ``gate`` is set: cancelling
    its await then is cancelling it "before its thread starts".
    """
    loop = asyncio.get_running_loop()
    loop.set_default_executor(
        ThreadPoolExecutor(1, thread_name_prefix="django-dlock-test-default")
    )
    blockers = [loop.run_in_executor(None, gate.wait, 30)]
    offload = getattr(backend, "offload", None)  # none on a893e4f
    if offload is not None:
        ops = offload.executor("ops")
        blockers += [
            asyncio.wrap_future(ops.submit(gate.wait, 30)) for _ in range(ops._max_workers)
        ]
    return blockers


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancelled_release_still_happens(
    backend_alias: str, backend: BaseLockBackend, name: str, kind: str
) -> None:
    """Cancelling ``await held.arelease()`` before its thread starts still releases.

    On a893e4f the release was queued on a worker thread; the cancellation
    took it off the queue before it ran, and the lease stayed until its TTL
    (here 60 s, against a 10 s timeout: LockTimeout).
    """
    make = _make(kind, backend)
    slots = range(2 if kind == "semaphore" else 1)

    async def scenario() -> None:
        held = await make(name, ttl=60).aacquire_handle()
        gate = threading.Event()
        blockers = _block_release_threads(backend, gate)
        releasing = asyncio.create_task(held.arelease())
        for _ in range(3):
            await asyncio.sleep(0)  # the release is on its way (queued, or sent)
        releasing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await releasing
        gate.set()
        await asyncio.gather(*blockers)
        assert held.released
        # Every slot is free again (60 s before the lease's TTL would free it).
        for again in [await make(name, ttl=60, timeout=10).aacquire_handle() for _ in slots]:
            await again.arelease()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancelled_release_at_loop_shutdown_still_happens(
    backend_alias: str, backend: BaseLockBackend, name: str, kind: str
) -> None:
    """``asyncio.run`` ends with the release cancelled and not yet run: it is run all the same."""
    make = _make(kind, backend)
    slots = range(2 if kind == "semaphore" else 1)
    holders: list[Any] = []
    gate = threading.Event()

    async def scenario() -> None:
        held = await make(name, ttl=60).aacquire_handle()
        holders.append(held)
        _block_release_threads(backend, gate)
        releasing = asyncio.create_task(held.arelease())
        for _ in range(3):
            await asyncio.sleep(0)
        releasing.cancel()
        # The threads are let go once asyncio.run() has cancelled what was left.
        threading.Timer(0.5, gate.set).start()

    asyncio.run(scenario())
    assert holders[0].released

    async def again() -> None:
        for taken in [await make(name, ttl=60, timeout=10).aacquire_handle() for _ in slots]:
            await taken.arelease()

    asyncio.run(again())


def test_a_cancelled_waiter_leaves_no_lease(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    """A waiter cancelled while it waits leaves nothing held once the holder releases."""

    async def scenario() -> None:
        first = await lock(name, backend=backend_alias, ttl=60).aacquire_handle()
        waiting = asyncio.create_task(
            lock(name, backend=backend_alias, ttl=60, timeout=30).aacquire_handle()
        )
        await asyncio.sleep(0.3)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await first.arelease()
        taken = await lock(name, backend=backend_alias, ttl=60, timeout=10).aacquire_handle()
        await taken.arelease()

    asyncio.run(scenario())


class _NoDefaultExecutor(ThreadPoolExecutor):
    """A default executor that fails the test if the lock's calls use it."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the async API used the event loop's default executor")


@pytest.mark.parametrize("kind", KINDS)
def test_the_default_executor_is_never_used(
    backend_alias: str, backend: BaseLockBackend, name: str, kind: str
) -> None:
    """Acquisitions that wait, releases, extends and checks all run on the backend's threads."""
    make = _make(kind, backend)
    limit = 2 if kind == "semaphore" else 1

    async def scenario() -> tuple[list[int], list[BaseException], int]:
        asyncio.get_running_loop().set_default_executor(_NoDefaultExecutor(1))
        held = await make(name, ttl=30).aacquire_handle()
        await held.aensure()
        await held.aextend(30)
        await held.arelease()
        return await _serve(make, name, 6, ttl=5, hold=0.01, limit=limit)

    order, errors, most = asyncio.run(scenario())
    assert errors == [], [f"{type(e).__name__}: {e}" for e in errors]
    assert sorted(order) == list(range(6))
    assert most <= limit


@pytest.mark.backends("db-sqlite", "db-postgresql", "db-mysql", "redis-cluster", "redlock")
def test_waiting_holds_no_thread(backend_alias: str, backend: BaseLockBackend, name: str) -> None:
    """20 waiters on the database or a Redis without native async: no thread per waiter.

    Only the backend's small executors run (its tries, and its releases), and
    no ``waits`` thread is started.
    """
    from django_dlock.backends.offload import OPS_THREADS, TRY_THREADS

    prefix = f"django-dlock-{backend_alias}-"

    def threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]

    async def scenario() -> list[str]:
        first = await lock(name, backend=backend_alias, ttl=30).aacquire_handle()
        run = asyncio.create_task(
            _serve(lambda n, **kw: lock(n, backend=backend_alias, **kw), name, 20, ttl=30,
                   hold=0.01, limit=1)
        )  # fmt: skip
        await asyncio.sleep(1.0)  # all 20 wait
        seen = threads()
        await first.arelease()
        order, errors, _ = await run
        assert errors == [] and sorted(order) == list(range(20))
        return seen

    seen = asyncio.run(scenario())
    assert len(seen) <= OPS_THREADS + TRY_THREADS, seen
    assert not [t for t in seen if t.startswith(f"{prefix}waits")], seen


def test_a_release_here_wakes_one_waiter_and_only_the_first_two_poll() -> None:
    """The wake-ups of ``offload.LocalWakes``: the first POLLERS waiters of a name poll on
    their backoff, the others wait to be woken, and a release wakes one: the one that
    joined first (or that the service queued first).
    """
    from django_dlock.backends.offload import POLLERS, LocalWakes

    wakes = LocalWakes()
    members = [object() for _ in range(5)]

    async def scenario() -> list[int]:
        woken: list[int] = []

        async def wait(index: int) -> None:
            await wakes.wait("n", members[index], 0.02, 30.0)
            woken.append(index)

        for member in members:
            wakes.join("n", member)
        tasks = [asyncio.create_task(wait(i)) for i in range(5)]
        await asyncio.sleep(0.5)  # the pollers' backoff (0.02 s) is long over
        assert sorted(woken) == list(range(POLLERS))
        wakes.wake("n")  # a release of "n" in this process
        await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return woken

    assert asyncio.run(scenario()) == [0, 1, 2]


_SESSIONS = {
    "postgresql": "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()",
    "mysql": "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE()",
}


@pytest.mark.backends("db-postgresql", "db-mysql")
@pytest.mark.with_default_db
def test_the_backends_threads_leave_no_connection_open(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    """The backend's own threads close their connections once idle.

    They outlive requests and tests: a connection each kept stayed idle for
    the life of the process, and ``manage.py test`` could not drop its test
    database ("is being accessed by other users"), found by tests/realproject.
    """
    from django.conf import settings
    from django.db import connections

    db = connections[settings.CONFORMANCE_BACKENDS[backend_alias]]

    def sessions() -> int:
        with db.cursor() as cursor:
            cursor.execute(_SESSIONS[db.vendor])
            return int(cursor.fetchone()[0])

    before = sessions()

    async def scenario() -> list[BaseException]:
        first = await lock(name, backend=backend_alias).aacquire_handle()
        run = asyncio.create_task(
            _serve(
                lambda n, **kw: lock(n, backend=backend_alias, **kw),
                name,
                10,
                ttl=5.0,
                hold=0.01,
                limit=1,
                stagger=0.01,
            )
        )
        await asyncio.sleep(0.3)
        await first.arelease()
        _, errors, _ = await run
        return errors

    assert asyncio.run(scenario()) == []
    deadline = time.monotonic() + 10  # the server ends a session just after its close
    while sessions() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sessions() == before
