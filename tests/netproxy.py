"""A TCP proxy that the tests (and the chaos run) control: held replies and added latency.

This kernel has no ``netem`` qdisc, so faults between a client and its server
are made here. Each client connection gets its own upstream connection; bytes
flow unchanged, except that:

- ``stall_replies(seconds)``: replies the server sends during the next
  ``seconds`` are held until that window ends. The server has run the
  commands (in order, at once); only the client does not hear back, so its
  socket timeout fires on a command that did take effect.
- ``delay_next_request(seconds)``: the next request chunk, on whichever
  connection sends it, is held this long; other connections' requests pass.
  A client that sends a second command on another connection meanwhile has
  it run first.
- ``latency``: every chunk, either way, is delayed this many seconds.
- ``jitter``: every reply chunk is delayed a random 0 to ``jitter`` seconds
  more, drawn per chunk: replies on different connections arrive in another
  order than the server sent them (on one connection TCP keeps the order).
- ``bunch``: every reply chunk is held until the next multiple of ``bunch``
  seconds: requests run at once, their replies come late and all together.

Every loop ends when the proxy is closed, and every socket has a timeout.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time


class Proxy:
    def __init__(
        self, target_port: int, *, latency: float = 0.0, listen: str = "127.0.0.1"
    ) -> None:
        self.target = ("127.0.0.1", target_port)
        self.latency = latency
        self.jitter = 0.0
        self.bunch = 0.0
        self._hold_until = 0.0
        self._delay_next = 0.0
        self._closed = threading.Event()
        # ``listen``: the chaos run (chaos/) serves workers in a network
        # namespace on the host's end of a veth pair.
        self._listener = socket.create_server((listen, 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._mutex = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, name="test-proxy", daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stall_replies(self, seconds: float) -> None:
        self._hold_until = time.monotonic() + seconds

    def delay_next_request(self, seconds: float) -> None:
        with self._mutex:
            self._delay_next = seconds

    def close(self) -> None:
        self._closed.set()
        with self._mutex:
            sockets, self._sockets = self._sockets, []
        for sock in [self._listener, *sockets]:
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._mutex:
                self._sockets += [client, upstream]
            for source, sink, replies in ((client, upstream, False), (upstream, client, True)):
                source.settimeout(0.2)
                pump = threading.Thread(
                    target=self._pump, args=(source, sink, replies), name="test-proxy", daemon=True
                )
                pump.start()
                self._threads.append(pump)

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while not self._closed.is_set():
                try:
                    chunk = source.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                delay = self.latency
                if replies:
                    now = time.monotonic()
                    delay = max(delay, self._hold_until - now)
                    if self.bunch > 0:
                        delay = max(delay, self.bunch - now % self.bunch)
                    if self.jitter > 0:
                        delay += random.uniform(0, self.jitter)
                else:
                    with self._mutex:
                        delay, self._delay_next = max(delay, self._delay_next), 0.0
                if delay > 0:
                    self._closed.wait(delay)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
