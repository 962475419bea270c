"""Pings with a time limit, for probes: ``locks check --timeout`` and the health check.

A ping to a server that accepts connections and never answers waits on the
client's own timeouts, and on a database without ``connect_timeout`` without
end. A probe must answer within its own limit, so the ping runs on a daemon
thread and the probe stops waiting for it. At most one ping per backend is
under way: a probe that comes while the last one still waits waits for that
one, so a silent server holds one thread, not one per probe.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from django.db import connections

from .backends.base import BaseLockBackend
from .backends.types import ServerStatus
from .exceptions import BackendUnavailable

#: backend -> (its ping under way, when it started by time.monotonic())
_in_flight: dict[BaseLockBackend, tuple[Future[ServerStatus], float]] = {}
_in_flight_mutex = threading.Lock()


def _after_fork_in_child() -> None:
    """The threads that would settle the pings under way did not come along."""
    global _in_flight_mutex
    _in_flight_mutex = threading.Lock()
    _in_flight.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def ping_in_thread(backend: BaseLockBackend) -> tuple[Future[ServerStatus], float]:
    """The ping of ``backend`` under way, or a new one on a daemon thread; and when it began."""
    with _in_flight_mutex:
        under_way = _in_flight.get(backend)
        if under_way is not None:
            return under_way
        future: Future[ServerStatus] = Future()
        # Running: a caller that gives up (an asyncio wrapper cancelled) cannot
        # cancel it, so the thread can always set its result.
        future.set_running_or_notify_cancel()
        _in_flight[backend] = under_way = (future, time.monotonic())

    def run() -> None:
        try:
            future.set_result(backend.ping())
        except BaseException as e:
            future.set_exception(e)
        finally:
            with _in_flight_mutex:
                del _in_flight[backend]
            if backend.uses_django_connections:
                connections.close_all()  # this thread's own: it ends here

    threading.Thread(target=run, name=f"dlock-ping:{backend.alias}", daemon=True).start()
    return under_way


def ping_within(backend: BaseLockBackend, timeout: float | None) -> ServerStatus:
    """``backend.ping()``, or ``BackendUnavailable`` if it has not answered within ``timeout``.

    None: no limit but the client's own timeouts (the ping runs here).
    """
    if timeout is None:
        return backend.ping()
    future, started = ping_in_thread(backend)
    try:
        return future.result(timeout)
    except FutureTimeout:
        raise BackendUnavailable(
            f"Lock backend {backend.alias!r} did not answer a ping within {timeout:g} s "
            f"(the ping started {time.monotonic() - started:.1f} s ago).",
            backend=backend.alias,
        ) from None
