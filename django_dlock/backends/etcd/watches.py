"""The etcd backend's watches: one Watch stream per backend and process.

A waiter watches the key just ahead of its own in the queue for its delete;
:meth:`Watches.watch` returns a :class:`Wake` whose event is set when that key
is deleted, when the watch cannot be kept (compacted, cancelled by etcd) or
when the stream ends. The waiter then checks the queue again in any case.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import grpc

from . import etcdrpc as rpc
from .etcdrpc import kv_pb2
from .transport import Transport

_DELETE = kv_pb2.Event.DELETE


class Wake:
    """One waiter's watch: ``event`` is set when the waiter should look again."""

    __slots__ = ("cancelled", "event", "watch_id")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.watch_id: int | None = None
        self.cancelled = False


class Watches:
    """One Watch stream per backend and process; each waiter watches one key.

    etcd answers create requests in order; like the Go client, this sends the
    next create only when the previous one is confirmed. Waiters do not wait
    for the confirmation: each watch starts at a past revision, so nothing
    that happens before it is established is missed.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._mutex = threading.Lock()
        self._outbox: queue.SimpleQueue[Any] | None = None
        self._call: Any = None
        self._creating: deque[Wake] = deque()
        self._held: deque[tuple[Wake, Any]] = deque()
        self._active: dict[int, Wake] = {}

    def watch(self, key: bytes, start_revision: int, end: bytes = b"") -> Wake:
        """Wake when ``key`` (or any key up to ``end``) is deleted after ``start_revision``."""
        wake = Wake()
        request = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=key,
                range_end=end,
                start_revision=start_revision,
                filters=[rpc.WatchCreateRequest.NOPUT],
            )
        )
        with self._mutex:
            if self._outbox is None:
                self._start()
            assert self._outbox is not None
            if self._creating:
                self._held.append((wake, request))
            else:
                self._creating.append(wake)
                self._outbox.put(request)
        return wake

    def cancel(self, wake: Wake) -> None:
        with self._mutex:
            wake.cancelled = True
            if wake.watch_id is not None:
                if self._active.pop(wake.watch_id, None) is not None and self._outbox:
                    self._outbox.put(_cancel(wake.watch_id))
            else:
                self._held = deque(item for item in self._held if item[0] is not wake)

    def close(self) -> None:
        with self._mutex:
            outbox, self._outbox = self._outbox, None
            call, self._call = self._call, None
            wakes = self._drop_all()
        if outbox is not None:
            outbox.put(None)
        if call is not None:
            # etcd keeps a watch stream open after the client half-closes it.
            call.cancel()
        for wake in wakes:
            wake.event.set()

    def _drop_all(self) -> list[Wake]:
        wakes = [*self._creating, *(w for w, _ in self._held), *self._active.values()]
        self._creating.clear()
        self._held.clear()
        self._active.clear()
        return wakes

    def _start(self) -> None:
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def requests() -> Iterator[Any]:
            while True:
                request = outbox.get()
                if request is None:
                    return
                yield request

        call = self._transport.stubs().watch.Watch(requests(), metadata=self._transport.metadata)
        self._outbox = outbox
        self._call = call
        thread = threading.Thread(
            target=self._run, args=(outbox, call), name="django-dlock-etcd-watch", daemon=True
        )
        thread.start()

    def _run(self, outbox: queue.SimpleQueue[Any], call: Any) -> None:
        try:
            for reply in call:
                self._handle(outbox, reply)
        except grpc.RpcError:
            pass  # every waiter re-checks below, and the next wait opens a new stream
        finally:
            with self._mutex:
                wakes = []
                if self._outbox is outbox:
                    self._outbox = None
                    self._call = None
                    wakes = self._drop_all()
            outbox.put(None)
            for wake in wakes:
                wake.event.set()

    def _handle(self, outbox: queue.SimpleQueue[Any], reply: Any) -> None:
        with self._mutex:
            if self._outbox is not outbox:
                return
            if reply.created:
                wake = self._creating.popleft() if self._creating else None
                if self._held:
                    nxt, request = self._held.popleft()
                    self._creating.append(nxt)
                    outbox.put(request)
                if wake is None:
                    return
                if reply.canceled or reply.compact_revision:
                    wake.event.set()  # e.g. compacted past our revision: re-check
                    return
                wake.watch_id = reply.watch_id
                if wake.cancelled:
                    outbox.put(_cancel(reply.watch_id))
                else:
                    self._active[reply.watch_id] = wake
                return
            wake = self._active.get(reply.watch_id)
            if wake is None:
                return
            if reply.canceled or any(event.type == _DELETE for event in reply.events):
                del self._active[reply.watch_id]
                if not reply.canceled:
                    outbox.put(_cancel(reply.watch_id))
                wake.event.set()


def _cancel(watch_id: int) -> Any:
    return rpc.WatchRequest(cancel_request=rpc.WatchCancelRequest(watch_id=watch_id))
