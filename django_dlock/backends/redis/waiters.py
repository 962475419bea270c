"""A process's asyncio waiters on a Redis lock share one subscription and one keeper.

A waiter in the sync loop blocks a connection of its own (``BLPOP`` on its
signal list) and re-runs ACQUIRE at least every second, which keeps its place
in the queue (a queued waiter that has not re-checked for WAITER_LEASE_MS is
presumed dead). Ten thousand asyncio tasks waiting like that in one process
need ten thousand connections (redis-py's asyncio pool refuses the 101st) and
ten thousand scripts a second to stay queued. Here, per event loop instead:

- one pub/sub connection, subscribed to the channel of each lock that has
  waiters here (named like its wake list; the scripts publish each hand-over
  as "waiter:token:granted_us:lease_ms" and each unfair wake-up as ""). A
  hand-over wakes only the waiter it names; a wake-up, only the waiter here
  that has waited longest;
- one keeper task per lock, which every WAIT_CAP (sooner when the holder's
  lease ends first) runs KEEP for all the queued waiters here, in batches:
  their deadlines move on as their own ACQUIRE would move them. It wakes a
  waiter that is no longer queued (a hand-over whose message was lost, a
  waiter dropped as dead while the process was stalled), and, when the lock
  is free with waiters queued (a holder died), the first waiter here, whose
  ACQUIRE then hands the lock to the head of the queue.

Messages published before the subscription took effect are lost, so a waiter
whose last ACQUIRE went out before then does not wait on it: it waits for the
subscription and re-checks. A waiter woken with nothing runs ACQUIRE, which
finds the lock handed to it or queues it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from ..types import Grant

logger = logging.getLogger("django_dlock")

#: How often the keeper refreshes the queue deadlines of the waiters here.
KEEP_EVERY = 1.0
#: Waiters per KEEP call: each call blocks the server while it runs.
KEEP_BATCH = 500
#: A waiter that nobody wakes re-checks on its own this often, in case the
#: keeper and the subscription both failed it.
SELF_CHECK = 30.0
#: Longest pause of the subscription reader or a keeper while Redis fails.
RETRY_CEILING = 1.0

#: keep(name, owners) -> (the lock's PTTL in ms, -2 if free; owners no longer queued)
Keep = Callable[[str, list[str]], Awaitable[tuple[int, list[str]]]]


class Waiter:
    """One acquisition waiting here: what the notifier knows of it."""

    __slots__ = ("__weakref__", "future", "name", "owner", "queued", "sent", "signal", "woken")

    def __init__(self, name: str, owner: str) -> None:
        self.name = name
        self.owner = owner
        #: When its latest ACQUIRE was sent (our clock).
        self.sent = 0.0
        #: Did its latest refused ACQUIRE leave it in the queue?
        self.queued = False
        #: A hand-over to it, "token:granted_us:lease_ms", not yet taken.
        self.signal: str | None = None
        self.woken = False
        self.future: asyncio.Future[None] | None = None

    def wake(self) -> None:
        self.woken = True
        future = self.future
        if future is not None and not future.done():
            future.set_result(None)


class Notifier:
    """The waiters of one event loop; see the module docstring."""

    def __init__(self, client: Any, channel: Callable[[str], str], keep: Keep) -> None:
        self.client = client
        self.channel = channel
        self.keep = keep
        # name -> owner -> Waiter; weak, so an attempt that ends without
        # saying so (an error before it was refused) leaves nothing behind.
        self.waiters: dict[str, weakref.WeakValueDictionary[str, Waiter]] = {}
        self.names: dict[bytes, str] = {}  # channel -> name, for the channels wanted
        self.pending: dict[bytes, int] = {}  # SUBSCRIBEs sent, not yet confirmed
        self.confirmed: dict[str, float] = {}  # name -> when its subscription took effect
        self.confirming: dict[str, asyncio.Event] = {}
        self.keepers: dict[str, asyncio.Task[None]] = {}
        self.pubsub: Any = None
        self.reader: asyncio.Task[None] | None = None

    # --- waiters -------------------------------------------------------------------

    def register(self, name: str, owner: str) -> Waiter:
        """The waiter for ``owner``, about to send an ACQUIRE that may queue it."""
        waiters = self.waiters.get(name)
        if waiters is None:
            waiters = self.waiters[name] = weakref.WeakValueDictionary()
        waiter = waiters.get(owner)
        if waiter is None:
            waiter = waiters[owner] = Waiter(name, owner)
        waiter.sent = time.monotonic()
        return waiter

    def unregister(self, waiter: Waiter) -> None:
        waiters = self.waiters.get(waiter.name)
        if waiters is not None:
            waiters.pop(waiter.owner, None)

    async def wait(self, waiter: Waiter, timeout: float) -> None:
        """Until ``waiter`` is handed the lock or woken, or ``timeout`` passes."""
        if waiter.signal is not None or waiter.woken:
            waiter.woken = False
            return
        name = waiter.name
        since = self.confirmed.get(name)
        if since is None or since > waiter.sent:
            # A hand-over published before the subscription took effect is
            # lost: wait for it to take effect, then re-check.
            await self._subscribed(name, timeout)
            return
        keeper = self.keepers.get(name)
        if keeper is None or keeper.done():
            self.keepers[name] = asyncio.get_running_loop().create_task(self._keeper(name))
        loop = asyncio.get_running_loop()
        future = waiter.future = loop.create_future()
        timer = loop.call_later(min(timeout, SELF_CHECK), _settle, future)
        try:
            await future
        finally:
            timer.cancel()
            waiter.future = None
            waiter.woken = False

    # --- the subscription ----------------------------------------------------------

    async def _subscribed(self, name: str, timeout: float) -> None:
        if name in self.confirmed:
            return  # it took effect after this waiter's ACQUIRE: re-check
        channel = self.channel(name).encode()
        event = self.confirming.get(name)
        if event is None:
            event = self.confirming[name] = asyncio.Event()
            self.names[channel] = name
            self.pending[channel] = self.pending.get(channel, 0) + 1
            if self.pubsub is None:
                self.pubsub = self.client.pubsub()
            try:
                await self.pubsub.subscribe(channel)
            except BaseException:
                self._forget(name, channel)
                raise
            if self.reader is None or self.reader.done():
                self.reader = asyncio.get_running_loop().create_task(self._read())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def _forget(self, name: str, channel: bytes) -> None:
        self.names.pop(channel, None)
        self.pending.pop(channel, None)
        self.confirmed.pop(name, None)
        event = self.confirming.pop(name, None)
        if event is not None:
            event.set()  # its waiters re-check, and subscribe again if they wait on

    async def _unsubscribe(self, name: str) -> None:
        channel = self.channel(name).encode()
        self._forget(name, channel)
        self.waiters.pop(name, None)
        if self.pubsub is not None:
            try:
                await self.pubsub.unsubscribe(channel)
            except Exception:
                logger.debug("Could not unsubscribe from %r", channel, exc_info=True)

    async def _read(self) -> None:
        """Deliver the messages of the subscribed channels while any is wanted."""
        failures = 0
        while self.names:
            try:
                message = await self.pubsub.get_message(timeout=KEEP_EVERY)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Lost connection: redis-py subscribes again when it reconnects,
                # but what was published meanwhile is lost. Every waiter re-checks.
                logger.debug("The lock waiters' subscription failed", exc_info=True)
                for channel, name in list(self.names.items()):
                    self.confirmed.pop(name, None)
                    self.pending[channel] = 0
                    self._wake_all(name)
                failures += 1
                await asyncio.sleep(min(RETRY_CEILING, 0.05 * 2**failures))
                continue
            failures = 0
            if message is not None:
                try:
                    self._deliver(message)
                except Exception:
                    logger.warning("Could not read a lock message: %r", message, exc_info=True)

    def _deliver(self, message: dict[str, Any]) -> None:
        channel = message.get("channel")
        name = self.names.get(channel) if isinstance(channel, bytes) else None
        if name is None:
            return
        kind = message.get("type")
        if kind == "subscribe":
            assert isinstance(channel, bytes)
            left = self.pending.get(channel, 0) - 1
            self.pending[channel] = max(left, 0)
            if left <= 0:
                self.confirmed[name] = time.monotonic()
                event = self.confirming.pop(name, None)
                if event is not None:
                    event.set()
            return
        if kind != "message":
            return
        waiters = self.waiters.get(name)
        if not waiters:
            return
        data = message["data"]
        if not data:
            # An unfair wake-up: the waiter here that has waited longest and
            # is not queued (queued ones are handed the lock instead).
            for unfair in list(waiters.values()):
                if not unfair.queued and unfair.future is not None:
                    unfair.wake()
                    return
            return
        owner, _, signal = data.decode().partition(":")
        waiter = waiters.get(owner)
        if waiter is not None:
            waiter.signal = signal
            waiter.wake()

    # --- the keeper ----------------------------------------------------------------

    def _wake_all(self, name: str) -> None:
        for waiter in list(self.waiters.get(name, {}).values()):
            waiter.wake()

    async def _keeper(self, name: str) -> None:
        """Keep this loop's queued waiters on ``name`` in the queue while there are any."""
        failures = 0
        while True:
            waiters = self.waiters.get(name)
            if not waiters:
                self.keepers.pop(name, None)
                await self._unsubscribe(name)
                return
            queued = [w for w in list(waiters.values()) if w.queued and w.signal is None]
            delay = KEEP_EVERY
            try:
                pttl, missing = -1, []
                for start in range(0, len(queued), KEEP_BATCH):
                    owners = [w.owner for w in queued[start : start + KEEP_BATCH]]
                    pttl, gone = await self.keep(name, owners)
                    missing.extend(gone)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Redis fails: every waiter re-checks, and meets the outage
                # in its own loop (which rides it out or gives up).
                logger.debug("Keeping the waiters on %r failed", name, exc_info=True)
                self._wake_all(name)
                failures += 1
                await asyncio.sleep(min(RETRY_CEILING, 0.05 * 2**failures))
                continue
            failures = 0
            for owner in missing:
                lost = waiters.get(owner)
                if lost is not None:
                    lost.wake()
            if queued and pttl == -2:
                # Free with waiters queued: a lease ran out. The first waiter
                # here re-checks; its ACQUIRE hands the lock to the queue's head.
                queued[0].wake()
            elif pttl >= 0:  # 0: in its last millisecond
                delay = min(delay, pttl / 1000 + 0.001)
            await asyncio.sleep(delay)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def take_handed(attempt: Any) -> Grant | None:
    """The lease ``wait()`` saw handed to ``owner``, if most of it is left.

    Its lease counts from when it was handed over, not from now: a
    waiter that was slow to see it (paused, stopped with SIGSTOP) may
    find it gone, or about to go, and handed to the next waiter. Then
    the attempt asks the server instead, which answers with the lease
    left if it is still ours, and queues it again if it is not.
    """
    if attempt.handed is None:
        return None
    handed, attempt.handed = attempt.handed, None
    left = handed.expires - time.monotonic()
    if left <= handed.lease / 2:
        return None
    # The watchdog's first renewal comes at a third of what is left.
    return Grant(handed.token, handed.expires, left)


def handed_over(queued_at: tuple[float, int], signal: str) -> Grant:
    """The lease in a hand-over signal "token:granted_us:lease_ms", on our clock."""
    token, granted_us, lease_ms = (int(part) for part in signal.split(":"))
    sent, server_us = queued_at
    # The refused attempt that queued us was answered at server time server_us,
    # at a moment of ours no earlier than `sent`; the grant came granted_us -
    # server_us later on the server's clock, so no earlier than this:
    granted = sent + (granted_us - server_us) / 1_000_000
    lease = lease_ms / 1000
    return Grant(token, granted + lease, lease)
