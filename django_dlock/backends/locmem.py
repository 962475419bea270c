"""An in-process backend for tests of user code.

Locks live in this process's memory: threads exclude each other, processes do
not. The "service clock" is this process's ``time.monotonic()``. Backends with
the same ``LOCATION`` share one store, as ``LocMemCache`` does.

Fencing tokens are seeded from the wall clock in microseconds the first time
a name is locked and count up by one from there, so that a new process (the
locmem equivalent of a restart that lost its data) issues larger tokens than
the one before it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from .._validation import load_holder, micros_to_datetime
from ..clocks import wall_micros
from .base import Attempt, LockInfo, ParkedTask, SlotEntry
from .ops import SlotAttempt
from .parking_backend import ParkingBackend
from .semaphore_backend import SemaphoreBackend

__all__ = ["LocMemBackend"]


@dataclass
class _Lease:
    owner: str
    token: int
    expires: float
    acquired_wall_us: int
    holder: str


@dataclass
class _Slots:
    """A semaphore: its limit, holders by owner, and waiters (owner -> weight, expiry)."""

    limit: int
    holders: dict[str, tuple[_Lease, int]]
    waiters: dict[str, tuple[int, float]]


class _Store:
    def __init__(self) -> None:
        # One condition for the whole store: a release wakes every waiter, each
        # re-checks its own name. Fine for a test backend.
        self.cond = threading.Condition(threading.Lock())
        self.leases: dict[tuple[str, str], _Lease] = {}
        self.fences: dict[tuple[str, str], int] = {}
        self.slots: dict[tuple[str, str], _Slots] = {}
        self.slot_fences: dict[tuple[str, str], int] = {}
        self.parked: dict[tuple[str, str], dict[str, ParkedTask]] = {}


_stores: dict[str, _Store] = {}
_stores_mutex = threading.Lock()


def _store(location: str) -> _Store:
    with _stores_mutex:
        return _stores.setdefault(location, _Store())


class LocMemAttempt(Attempt):
    """Waits on the store's condition, which every release and break notifies."""

    backend: LocMemBackend

    def interrupt(self) -> None:
        """Wake every waiter of the store (each re-checks): this one sees it stopped."""
        with self.backend._store.cond:
            self.backend._store.cond.notify_all()

    def wait(self, remaining: float | None) -> None:
        """Sleep until a release or break is signalled, or the holder's lease runs out."""
        backend = self.backend
        with backend._store.cond:
            now = time.monotonic()
            lease = backend._live(backend._key(self.name), now)
            if lease is None or self.stopped:
                return
            until_expiry = lease.expires - now
            backend._store.cond.wait(
                until_expiry if remaining is None else min(remaining, until_expiry)
            )


class LocMemSlotAttempt(SlotAttempt):
    """Waits on the store's condition, until a holder's lease or a third of the TTL ends."""

    backend: LocMemBackend

    def interrupt(self) -> None:
        """Wake every waiter of the store (each re-checks): this one sees it stopped."""
        cond = self.backend._store.cond
        with cond:
            cond.notify_all()

    def wait(self, remaining: float | None) -> None:
        backend = self.backend
        bound = self.ttl / 3 if remaining is None else min(remaining, self.ttl / 3)
        with backend._store.cond:
            now = time.monotonic()
            slots = backend._live_slots(backend._key(self.name), now)
            if slots is None or not slots.holders or self.stopped:
                return
            first_end = min(lease.expires for lease, _ in slots.holders.values())
            backend._store.cond.wait(max(0.0, min(bound, first_end - now)))


class LocMemBackend(SemaphoreBackend, ParkingBackend):
    supports_wakeups = True
    attempt_class = LocMemAttempt
    supports_multiprocess = False
    supports_fair_semaphores = False
    slot_attempt_class = LocMemSlotAttempt

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self._store = _store(str(self.location or ""))

    def _key(self, name: str) -> tuple[str, str]:
        return (self.key_prefix, name)

    def _live(self, key: tuple[str, str], now: float) -> _Lease | None:
        lease = self._store.leases.get(key)
        if lease is not None and lease.expires <= now:
            del self._store.leases[key]
            return None
        return lease

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | None:
        key = self._key(name)
        store = self._store
        with store.cond:
            now = time.monotonic()
            if self._live(key, now) is not None:
                return None
            last = store.fences.get(key)
            token = wall_micros() if last is None else last + 1
            store.fences[key] = token
            store.leases[key] = _Lease(owner, token, now + ttl, wall_micros(), holder)
            return token

    def do_release(self, name: str, owner: str) -> bool:
        key = self._key(name)
        with self._store.cond:
            lease = self._live(key, time.monotonic())
            if lease is None or lease.owner != owner:
                return False
            del self._store.leases[key]
            self._store.cond.notify_all()
            return True

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        with self._store.cond:
            now = time.monotonic()
            lease = self._live(self._key(name), now)
            if lease is None or lease.owner != owner:
                return False
            lease.expires = now + ttl
            return True

    def do_adopt(self, name: str, owner: str, new_owner: str, ttl: float, state: Any) -> bool:
        with self._store.cond:
            now = time.monotonic()
            lease = self._live(self._key(name), now)
            if lease is None or lease.owner != owner:
                return False
            lease.owner, lease.expires = new_owner, now + ttl
            return True

    def do_check(self, name: str, owner: str) -> bool:
        with self._store.cond:
            lease = self._live(self._key(name), time.monotonic())
            return lease is not None and lease.owner == owner

    def do_break(self, name: str, token: int | None) -> bool:
        key = self._key(name)
        with self._store.cond:
            lease = self._live(key, time.monotonic())
            if lease is None or (token is not None and lease.token != token):
                return False
            del self._store.leases[key]
            self._store.cond.notify_all()
            return True

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        return "locmem (this process's memory)", ()

    def do_list(self, prefix: str) -> list[LockInfo]:
        infos = []
        with self._store.cond:
            now = time.monotonic()
            for key in list(self._store.leases):
                if key[0] != self.key_prefix or not key[1].startswith(prefix):
                    continue
                info = self._info(key, now)
                if info is not None:
                    infos.append(info)
        return infos

    def do_get(self, name: str) -> LockInfo | None:
        with self._store.cond:
            return self._info(self._key(name), time.monotonic())

    def _info(self, key: tuple[str, str], now: float) -> LockInfo | None:
        """The live lease under ``key`` as a LockInfo (the store's lock held)."""
        lease = self._live(key, now)
        return None if lease is None else self._lease_info(key[1], lease, now)

    def _lease_info(self, name: str, lease: _Lease, now: float) -> LockInfo:
        remaining = lease.expires - now
        return LockInfo(
            backend=self.alias,
            name=name,
            token=lease.token,
            holder=load_holder(lease.holder),
            acquired_at=micros_to_datetime(lease.acquired_wall_us),
            expires_at=micros_to_datetime(wall_micros() + int(remaining * 1e6)),
            expires_in=remaining,
        )

    # --- semaphores ------------------------------------------------------------------

    def _live_slots(self, key: tuple[str, str], now: float) -> _Slots | None:
        """The semaphore under ``key`` without its ended leases and waiters (store locked)."""
        slots = self._store.slots.get(key)
        if slots is None:
            return None
        for owner in [o for o, (lease, _) in slots.holders.items() if lease.expires <= now]:
            del slots.holders[owner]
        for owner in [o for o, (_, end) in slots.waiters.items() if end <= now]:
            del slots.waiters[owner]
        if not slots.holders and not slots.waiters:
            del self._store.slots[key]
            return None
        return slots

    def do_acquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> int | None:
        key = self._key(name)
        store = self._store
        with store.cond:
            now = time.monotonic()
            slots = self._live_slots(key, now)
            if slots is None:
                slots = store.slots[key] = _Slots(limit, {}, {})
            elif slots.limit != limit:
                raise self.limit_mismatch(name, limit, slots.limit)
            used = sum(w for _, w in slots.holders.values())
            writer_waits = weight < limit and any(
                w == limit for o, (w, _) in slots.waiters.items() if o != owner
            )
            if used + weight > limit or writer_waits:
                slots.waiters[owner] = (weight, now + ttl)
                return None
            last = store.slot_fences.get(key)
            token = wall_micros() if last is None else last + 1
            store.slot_fences[key] = token
            lease = _Lease(owner, token, now + ttl, wall_micros(), holder)
            slots.holders[owner] = (lease, weight)
            slots.waiters.pop(owner, None)
            return token

    def _slot_of(self, name: str, owner: str) -> tuple[_Slots, _Lease] | None:
        slots = self._live_slots(self._key(name), time.monotonic())
        if slots is None or owner not in slots.holders:
            return None
        return slots, slots.holders[owner][0]

    def do_leave_slot(self, name: str, owner: str) -> None:
        with self._store.cond:
            slots = self._live_slots(self._key(name), time.monotonic())
            if slots is not None and slots.waiters.pop(owner, None) is not None:
                self._store.cond.notify_all()  # readers held back by a writer

    def do_release_slot(self, name: str, owner: str) -> bool:
        with self._store.cond:
            found = self._slot_of(name, owner)
            if found is None:
                return False
            del found[0].holders[owner]
            self._store.cond.notify_all()
            return True

    def do_extend_slot(self, name: str, owner: str, ttl: float) -> bool:
        with self._store.cond:
            found = self._slot_of(name, owner)
            if found is None:
                return False
            found[1].expires = time.monotonic() + ttl
            return True

    def do_check_slot(self, name: str, owner: str) -> bool:
        with self._store.cond:
            return self._slot_of(name, owner) is not None

    def do_break_slot(self, name: str, token: int | None) -> int:
        with self._store.cond:
            slots = self._live_slots(self._key(name), time.monotonic())
            if slots is None:
                return 0
            owners = [o for o, (lease, _) in slots.holders.items() if token in (None, lease.token)]
            for owner in owners:
                del slots.holders[owner]
            if owners:
                self._store.cond.notify_all()
            return len(owners)

    def do_list_slots(self, prefix: str) -> list[SlotEntry]:
        entries = []
        with self._store.cond:
            now = time.monotonic()
            for key in list(self._store.slots):
                if key[0] != self.key_prefix or not key[1].startswith(prefix):
                    continue
                slots = self._live_slots(key, now)
                if slots is None:
                    continue
                for lease, weight in slots.holders.values():
                    info = self._lease_info(key[1], lease, now)
                    entries.append(SlotEntry(key[1], slots.limit, weight, info))
                for weight, _ in slots.waiters.values():
                    entries.append(SlotEntry(key[1], slots.limit, weight, None))
        return entries

    def do_park(self, name: str, key: str, order: int, payload: str) -> None:
        with self._store.cond:
            queue = self._store.parked.setdefault(self._key(name), {})
            queue[key] = ParkedTask(name, key, order, payload)

    def do_unpark(self, name: str, count: int) -> list[ParkedTask]:
        with self._store.cond:
            queue = self._store.parked.get(self._key(name), {})
            first = sorted(queue.values(), key=lambda p: (p.order, p.key))[:count]
            for parked in first:
                del queue[parked.key]
            return first

    def do_unpark_key(self, name: str, key: str) -> bool:
        with self._store.cond:
            return self._store.parked.get(self._key(name), {}).pop(key, None) is not None

    def do_list_parked(self, prefix: str) -> list[ParkedTask]:
        with self._store.cond:
            return [
                parked
                for key, queue in self._store.parked.items()
                if key[0] == self.key_prefix and key[1].startswith(prefix)
                for parked in queue.values()
            ]
