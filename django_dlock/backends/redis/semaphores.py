"""Semaphores, read/write locks and parked tasks on Redis: two parts of the contract.

:class:`RedisSemaphores` (``SemaphoreBackend``) and :class:`RedisParking`
(``ParkingBackend``), which :class:`~.backend.RedisBackend` declares and
:class:`~.redlock.RedlockBackend` does not.

The scripts and their key layout are in ``slot_scripts.py``. A semaphore's
keys carry the hash tag of its name's shard (the mutex's), so each script
runs in one Cluster slot, and each shard keeps an index of its semaphores
and of its parked queues, read page by page as the mutex's index is.
"""

from __future__ import annotations

import time
from typing import Any

from ..._validation import load_holders
from ...clocks import ms
from ...exceptions import BackendUnavailable
from ..base import Grant, LockInfo, ParkedTask, SlotEntry, micros_to_datetime
from ..ops import SlotAttempt
from ..parking_backend import ParkingBackend
from .connections import CLIENT_ERRORS, Node, text
from .listing import lex_range
from .semaphores_aio import RedisSemaphoresAsync
from .slot_keys import RedisSlotKeys
from .slot_scripts import (
    PARK,
    PARK_LIST,
    SLOT_ACQUIRE,
    SLOT_BREAK,
    SLOT_CHECK,
    SLOT_EXTEND,
    SLOT_LEAVE,
    SLOT_LIST,
    SLOT_RELEASE,
    UNPARK,
    UNPARK_KEY,
)

#: Semaphores a SLOT_LIST call reads (each with all its holders and waiters).
SLOT_LIST_PAGE = 500


class RedisSlotAttempt(SlotAttempt):
    """One acquisition of a slot, woken by the semaphore's wake list.

    A refused try learns when the semaphore may change by itself (the
    earliest lease, or waiting writer, that holds it back ends); its wait
    blocks on the wake list (BLPOP) no longer than that, a third of its TTL
    (its waiter record must be refreshed before it ends) or WAIT_CAP. From
    the event loop (native async on one server, or the polling of an async
    acquisition elsewhere) it waits with no connection: the backoff, cut
    short by a release in this process, and no longer than that either.
    """

    #: Milliseconds until the semaphore may change by itself, as of the
    #: latest refusal (0: unknown).
    change_ms: int = 0

    backend: RedisSemaphores

    @property
    def redis(self) -> RedisSemaphores:
        return self.backend

    def try_acquire(self) -> int | Grant | None:
        result, self.change_ms = self.redis.acquire_slot(
            self.name, self.owner, self.ttl, self.holder[1], self.limit, self.weight
        )
        return result

    def wait(self, remaining: float | None) -> None:
        self.redis.block_on_slot(self, remaining)

    async def await_free(self, remaining: float | None) -> None:
        # Polled on the event loop rather than a BLPOP holding a thread and
        # a connection; no longer than until the semaphore may change by itself.
        if self.change_ms > 0:
            soon = self.change_ms / 1000 + 0.001
            remaining = soon if remaining is None else min(remaining, soon)
        await super().await_free(remaining)

    # Native async (one server): the same script from the event loop.

    async def atry_acquire(self) -> int | Grant | None:
        result, self.change_ms = await self.redis.aacquire_slot(
            self.name, self.owner, self.ttl, self.holder[1], self.limit, self.weight
        )
        return result

    async def await_(self, remaining: float | None) -> None:
        await self.await_free(remaining)

    async def aabandon(self) -> None:
        await self.redis.ado_leave_slot(self.name, self.owner)


class RedisSemaphores(RedisSemaphoresAsync):
    """The ``*_slot`` primitives of :class:`~.backend.RedisBackend`: its semaphores part.

    The awaitable ones, on one server, are native (``semaphores_aio.py``).
    """

    slot_attempt_class = RedisSlotAttempt

    # --- slots ------------------------------------------------------------------------

    def acquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, limit: int, weight: int
    ) -> tuple[int | Grant | None, int]:
        """One SLOT_ACQUIRE: its result, and the ms until the semaphore may change (refused)."""
        keys = self.slot_keys(name).slots
        args = [owner, name, ms(ttl), holder, limit, weight]
        sent = time.monotonic()
        reply = self._slot_script(name, SLOT_ACQUIRE, keys, args)
        return self.slot_outcome(name, limit, reply, sent)

    def block_on_slot(self, attempt: RedisSlotAttempt, remaining: float | None) -> None:
        """Block on ``attempt``'s semaphore's wake list; see :class:`RedisSlotAttempt`."""
        timeout = min(self._blocking_cap, attempt.ttl / 3)
        if attempt.change_ms > 0:
            timeout = min(timeout, attempt.change_ms / 1000 + 0.001)
        if remaining is not None:
            timeout = min(timeout, remaining)
        if timeout < 0.001:
            return
        wake = self.slot_keys(attempt.name).slots[6]
        started = time.monotonic()
        try:
            self.nodes[0].command("BLPOP", wake, round(timeout, 3))
        except (*CLIENT_ERRORS, BackendUnavailable):
            # The next try reports the outage; until then, no busy loop.
            time.sleep(max(0.0, timeout - (time.monotonic() - started)))

    def do_acquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> int | Grant | None:
        return self.acquire_slot(name, owner, ttl, holder, limit, weight)[0]

    def do_leave_slot(self, name: str, owner: str) -> None:
        self._slot_script(name, SLOT_LEAVE, self.slot_keys(name).slots, [owner, name])

    def do_release_slot(self, name: str, owner: str) -> bool:
        keys = self.slot_keys(name)
        marker = self._marker(keys, owner)
        args = [owner, name, self._done_ms]
        return bool(self._slot_script(name, SLOT_RELEASE, [*keys.slots, marker], args))

    def do_extend_slot(self, name: str, owner: str, ttl: float) -> bool:
        args = [owner, name, ms(ttl)]
        return bool(self._slot_script(name, SLOT_EXTEND, self.slot_keys(name).slots, args))

    def do_check_slot(self, name: str, owner: str) -> bool:
        holders = self.slot_keys(name).slots[0]
        return bool(self._slot_script(name, SLOT_CHECK, [holders], [owner]))

    def do_break_slot(self, name: str, token: int | None) -> int:
        keys = self.slot_keys(name)
        marker = self._marker(keys, "break")
        args = ["", name, "" if token is None else str(token), self._done_ms]
        return int(self._slot_script(name, SLOT_BREAK, [*keys.slots, marker], args))

    def do_list_slots(self, prefix: str) -> list[SlotEntry]:
        low, high = (bound.encode("utf-8", "surrogateescape") for bound in lex_range(prefix))
        alias = self.alias

        def read(node: Node) -> list[SlotEntry]:
            entries: list[SlotEntry] = []
            for tag in self._tags:
                args = [low, high, f"{tag}:sem:", SLOT_LIST_PAGE]
                for reply in node.pages(SLOT_LIST, [f"{tag}:sem:idx"], args):
                    entries.extend(parse_slot_list(alias, reply))
            return entries

        result: list[SlotEntry] = self._single(prefix, read)
        return result


class RedisParking(RedisSlotKeys, ParkingBackend):
    """The ``*park*`` primitives of :class:`~.backend.RedisBackend`: its parking part."""

    def do_park(self, name: str, key: str, order: int, payload: str) -> None:
        keys = self.slot_keys(name).park
        self._slot_script(name, PARK, keys, [name, key, order, payload])

    def do_unpark(self, name: str, count: int) -> list[ParkedTask]:
        keys = self.slot_keys(name)
        marker = self._marker(keys, "unpark")
        reply = self._slot_script(name, UNPARK, [*keys.park, marker], [name, count, self._done_ms])
        return parse_parked(name, reply)

    def do_unpark_key(self, name: str, key: str) -> bool:
        keys = self.slot_keys(name)
        marker = self._marker(keys, "unpark")
        args = [name, key, self._done_ms]
        return bool(self._slot_script(name, UNPARK_KEY, [*keys.park, marker], args))

    def do_list_parked(self, prefix: str) -> list[ParkedTask]:
        low, high = (bound.encode("utf-8", "surrogateescape") for bound in lex_range(prefix))

        def read(node: Node) -> list[ParkedTask]:
            parked: list[ParkedTask] = []
            for tag in self._tags:
                args = [low, high, f"{tag}:park:", SLOT_LIST_PAGE]
                for reply in node.pages(PARK_LIST, [f"{tag}:park:idx"], args):
                    for name, entries in zip(reply[2::2], reply[3::2], strict=True):
                        parked.extend(parse_parked(text(name), entries))
            return parked

        result: list[ParkedTask] = self._single(prefix, read)
        return result


def parse_parked(name: str, flat: list[Any]) -> list[ParkedTask]:
    """``{key1, "order1:payload1", ...}`` as ParkedTasks of ``name``, in that order."""
    parked = []
    for key, entry in zip(flat[0::2], flat[1::2], strict=True):
        order, _, payload = text(entry).partition(":")
        parked.append(ParkedTask(name, text(key), int(order), payload))
    return parked


def parse_slot_list(alias: str, reply: list[Any]) -> list[SlotEntry]:
    """A SLOT_LIST reply as SlotEntries: each semaphore's holders, then its waiters."""
    now_us = int(reply[0])
    entries = []
    for name_b, limit_b, held, weights in zip(
        reply[2::4], reply[3::4], reply[4::4], reply[5::4], strict=True
    ):
        name, limit = text(name_b), int(limit_b)
        for value, left in zip(held[0::2], held[1::2], strict=True):
            token_s, weight_s, acquired_s, holder_json = text(value).split(":", 3)
            (holder,), faithful = load_holders([holder_json])
            left_ms = int(left)
            info = LockInfo(
                alias,
                name,
                int(token_s),
                holder,
                micros_to_datetime(int(acquired_s)),
                micros_to_datetime(now_us + left_ms * 1000),
                left_ms / 1000,
                holder_json if faithful else None,
            )
            entries.append(SlotEntry(name, limit, int(weight_s), info))
        entries.extend(SlotEntry(name, limit, int(w), None) for w in weights)
    return entries
