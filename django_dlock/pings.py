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
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from django.db import connections

from .backends.base import BaseLockBackend
from .backends.types import ServerStatus
from .exceptions import BackendUnavailable

T = TypeVar("T")


class UnderWay:
    """Calls under way, per backend, behind one mutex; a forked child forgets them.

    The threads that would end them did not come along into the child.
    """

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.calls: dict[BaseLockBackend, Any] = {}
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self.mutex = threading.Lock()
        self.calls.clear()


def on_daemon_thread(call: Callable[[], T], name: str, done: Callable[[], None]) -> Future[T]:
    """``call()`` on a daemon thread of its own; then ``done()`` there, whatever happened.

    The future is running from the start: a caller that gives up (an asyncio
    wrapper cancelled) cannot cancel it, so the thread can always set it.
    """
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as e:
            future.set_exception(e)
        finally:
            done()

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


#: backend -> (its ping under way, when it started by time.monotonic())
_pings = UnderWay()


def ping_in_thread(backend: BaseLockBackend) -> tuple[Future[ServerStatus], float]:
    """The ping of ``backend`` under way, or a new one on a daemon thread; and when it began."""
    with _pings.mutex:
        under_way: tuple[Future[ServerStatus], float] | None = _pings.calls.get(backend)
        # A finished ping may not be forgotten yet (its thread sets the result,
        # then forgets it): it answered for the server as it was, not as it is.
        if under_way is not None and not under_way[0].done():
            return under_way

        mine: list[Future[ServerStatus]] = []

        def done() -> None:
            with _pings.mutex:
                entry = _pings.calls.get(backend)
                if entry is not None and mine and entry[0] is mine[0]:
                    del _pings.calls[backend]  # not a newer ping that replaced this one
            if backend.uses_django_connections:
                connections.close_all()  # this thread's own: it ends here

        future = on_daemon_thread(backend.ping, f"dlock-ping:{backend.alias}", done)
        mine.append(future)
        _pings.calls[backend] = under_way = (future, time.monotonic())
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
