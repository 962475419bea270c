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
from .base import Attempt, BaseLockBackend, LockInfo


@dataclass
class _Lease:
    owner: str
    token: int
    expires: float
    acquired_wall_us: int
    holder: str


class _Store:
    def __init__(self) -> None:
        # One condition for the whole store: a release wakes every waiter, each
        # re-checks its own name. Fine for a test backend.
        self.cond = threading.Condition(threading.Lock())
        self.leases: dict[tuple[str, str], _Lease] = {}
        self.fences: dict[tuple[str, str], int] = {}


_stores: dict[str, _Store] = {}
_stores_mutex = threading.Lock()


def _store(location: str) -> _Store:
    with _stores_mutex:
        return _stores.setdefault(location, _Store())


class LocMemAttempt(Attempt):
    """Waits on the store's condition, which every release and break notifies."""

    backend: LocMemBackend

    def wait(self, remaining: float | None) -> None:
        """Sleep until a release or break is signalled, or the holder's lease runs out."""
        backend = self.backend
        with backend._store.cond:
            now = time.monotonic()
            lease = backend._live(backend._key(self.name), now)
            if lease is None:
                return
            until_expiry = lease.expires - now
            backend._store.cond.wait(
                until_expiry if remaining is None else min(remaining, until_expiry)
            )


class LocMemBackend(BaseLockBackend):
    supports_wakeups = True
    attempt_class = LocMemAttempt
    supports_multiprocess = False

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
            token = time.time_ns() // 1000 if last is None else last + 1
            store.fences[key] = token
            store.leases[key] = _Lease(owner, token, now + ttl, time.time_ns() // 1000, holder)
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
        if lease is None:
            return None
        remaining = lease.expires - now
        return LockInfo(
            backend=self.alias,
            name=key[1],
            token=lease.token,
            holder=load_holder(lease.holder),
            acquired_at=micros_to_datetime(lease.acquired_wall_us),
            expires_at=micros_to_datetime(time.time_ns() // 1000 + int(remaining * 1e6)),
            expires_in=remaining,
        )
