"""The etcd backend's semaphores, read/write locks and parked Celery calls.

Keys, for ``KEY_PREFIX`` P, semaphore N (escaped as lock names are) and the
acquisition's owner token O::

    Pdlock-slots/N/O     value: {"limit", "weight", "holder"}; attached to a lease
                         of the acquisition's own (its TTL, whole seconds)
    Pdlock-parked/N/C    value: {"place", "payload"}; no lease (Celery call id C)

They live outside ``Pdlock/``, so the mutexes' listing never reads them.

The semaphore is a queue, as the mutex is: an acquisition puts its key once
(``create_revision == 0``), and its key's create revision orders it among
the others. Key i is granted when the weights of the keys up to and
including it, in create-revision order, fit in the limit: strictly first
come, first served, so a waiting writer (weight == limit) holds back every
reader behind it. The fencing token is the key's create revision: under
strict FIFO, grants follow revision order, so tokens increase per name.
A waiter watches the semaphore's range for deletes after the revision at
which it looked (any key ahead of it that goes may grant it), and its key
goes when it gives up, or with its lease if it dies.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from etcd3 import etcdrpc as rpc

from ..._validation import load_holder
from ..base import BaseLockBackend, Grant, LockInfo, ParkedTask, SlotEntry
from ..slots import SlotAttempt
from .sessions import Entry, Sessions, lease_seconds
from .transport import CREATE_ASC, created_at, delete, get, put, range_end, txn


def _escape(name: str) -> bytes:
    return name.replace("%", "%25").replace("/", "%2F").encode()


def _unescape(part: bytes) -> str:
    from urllib.parse import unquote

    return unquote(part.decode(errors="replace"))


class EtcdSlotAttempt(SlotAttempt):
    """Waits on a watch of the semaphore's range for a delete."""

    #: The revision at which the last try looked (0: unknown).
    revision: int = 0

    def try_acquire(self) -> int | Grant | None:
        base: EtcdSlots = self.backend.base  # type: ignore[assignment]
        result, self.revision = base.try_slot(
            self.name, self.owner, self.ttl, self.holder[1], self.backend.limit,
            self.backend.weight,
        )  # fmt: skip
        return result

    def wait(self, remaining: float | None) -> None:
        base: EtcdSlots = self.backend.base  # type: ignore[assignment]
        timeout = self.ttl / 3 if remaining is None else min(remaining, self.ttl / 3)
        if timeout > 0 and self.revision:
            base.watch_slots(self.name, self.revision, timeout)


class EtcdSlots(BaseLockBackend):
    """The ``*_slot`` and parking primitives of :class:`~.backend.EtcdBackend`."""

    supports_semaphores = True
    supports_fair_semaphores = True
    slot_attempt_class = EtcdSlotAttempt

    if TYPE_CHECKING:
        root: bytes

        @property
        def state(self) -> Sessions: ...
        def _call(self, name: str, stub: str, method: str, request: Any, **kw: Any) -> Any: ...
        def _txn(self, name: str, request: Any, **kwargs: Any) -> Any: ...

    def _slots_root(self) -> bytes:
        return self.root[:-1] + b"-slots/"

    def _parked_root(self) -> bytes:
        return self.root[:-1] + b"-parked/"

    def _slots_base(self, name: str) -> bytes:
        return self._slots_root() + _escape(name) + b"/"

    def _parked_base(self, name: str) -> bytes:
        return self._parked_root() + _escape(name) + b"/"

    def try_slot(
        self, name: str, owner: str, ttl: float, holder: str, limit: int, weight: int
    ) -> tuple[int | Grant | None, int]:
        """One try: (the token, a Grant or None; the revision it looked at)."""
        state = self.state
        base = self._slots_base(name)
        end = range_end(base)
        entry = state.entries.get(owner)
        sent = time.monotonic()
        if entry is None:
            lease = state.grant(name, lease_seconds(ttl), private=True)
            key = base + owner.encode()
            entry = Entry(base, key, lease, lease)
            with state.mutex:
                state.entries[owner] = entry
            value = json.dumps({"limit": limit, "weight": weight, "holder": holder}).encode()
            try:
                reply = self._txn(
                    name,
                    txn(
                        [created_at(key, 0)],
                        [put(key, lease.id, value), get(base, end, **CREATE_ASC)],
                    ),
                )
            except BaseException:
                state.forget(owner)  # revokes the lease: the key goes with it
                raise
            if not reply.succeeded:
                state.forget(owner)
                return None, reply.header.revision  # cannot be: owner tokens are unique
            entry.revision = reply.header.revision
            kvs = reply.responses[1].response_range.kvs
        else:
            if entry.lease.expires - time.monotonic() < entry.lease.ttl / 2:
                state.keepalive(name, entry.lease)
            reply = self._txn(
                name, txn([created_at(entry.key, entry.revision)], [get(base, end, **CREATE_ASC)])
            )
            if not reply.succeeded:
                # Our key went (its lease ran out, or it was broken): queue again.
                state.forget(owner)
                return None, reply.header.revision
            kvs = reply.responses[0].response_range.kvs
        used = 0
        for kv in kvs:
            data = _value(kv)
            if data["limit"] != limit:
                self.do_leave_slot(name, owner)
                raise self.limit_mismatch(name, limit, int(data["limit"]))
            used += int(data["weight"])
            if kv.create_revision == entry.revision:
                break
        if used > limit:
            return None, reply.header.revision
        lease = entry.lease
        if lease.expires - lease.ttl >= sent:
            return entry.revision, 0  # the lease began within this try
        return Grant(
            entry.revision, lease.expires, max(lease.expires - time.monotonic(), 0.001)
        ), 0

    def watch_slots(self, name: str, revision: int, timeout: float) -> None:
        """Wait for a delete under ``name``'s keys after ``revision``, or ``timeout``."""
        base = self._slots_base(name)
        watches = self.state.watches
        wake = watches.watch(base, revision + 1, range_end(base))
        try:
            wake.event.wait(timeout)
        finally:
            watches.cancel(wake)

    def do_acquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> int | Grant | None:
        return self.try_slot(name, owner, ttl, holder, limit, weight)[0]

    def do_leave_slot(self, name: str, owner: str) -> None:
        entry = self.state.forget(owner, revoke=False)
        if entry is not None:
            self.state.delete_entry(name, entry)

    def do_release_slot(self, name: str, owner: str) -> bool:
        entry = self.state.forget(owner, revoke=False)
        if entry is None:
            return False
        retried: list[bool] = []
        reply = self.state.delete_entry(name, entry, ambiguous=retried)
        return bool(reply.succeeded) or bool(retried)

    def _slot_entry(self, name: str, owner: str) -> Entry | None:
        entry = self.state.entries.get(owner)
        if entry is None:
            return None
        reply = self._call(name, "kv", "Range", rpc.RangeRequest(key=entry.key, keys_only=True))
        if reply.kvs and reply.kvs[0].create_revision == entry.revision:
            return entry
        self.state.forget(owner)
        return None

    def do_extend_slot(self, name: str, owner: str, ttl: float) -> bool:
        entry = self.state.entries.get(owner)
        if entry is None:
            return False
        seconds = lease_seconds(ttl)
        if seconds != entry.lease.ttl:
            lease = self.state.grant(name, seconds, private=True)
            reply = self._txn(
                name, txn([created_at(entry.key, entry.revision)], [put(entry.key, lease.id)])
            )
            if not reply.succeeded:
                self.state.revoke_quietly(lease)
                self.state.forget(owner)
                return False
            old, entry.lease = entry.lease, lease
            self.state.revoke_quietly(old)
            return True
        if not self.state.keepalive(name, entry.lease):
            self.state.forget(owner)
            return False
        return self._slot_entry(name, owner) is not None

    def do_check_slot(self, name: str, owner: str) -> bool:
        return self._slot_entry(name, owner) is not None

    def do_break_slot(self, name: str, token: int | None) -> int:
        freed = 0
        for entry in self.do_list_slots_exact(name):
            kv, granted = entry
            if not granted or (token is not None and kv.create_revision != token):
                continue
            reply = self._txn(
                name, txn([created_at(kv.key, kv.create_revision)], [delete(kv.key)])
            )
            freed += bool(reply.succeeded)
        return freed

    def do_list_slots_exact(self, name: str) -> list[tuple[Any, bool]]:
        """``name``'s keys in queue order, each with whether it holds a slot."""
        base = self._slots_base(name)
        reply = self._call(
            name,
            "kv",
            "Range",
            rpc.RangeRequest(key=base, range_end=range_end(base), **CREATE_ASC),
        )
        return _granted(reply.kvs)

    def do_list_slots(self, prefix: str) -> list[SlotEntry]:
        start = self._slots_root() + _escape(prefix)
        reply = self._call(
            prefix or "*", "kv", "Range",
            rpc.RangeRequest(key=start, range_end=range_end(start), **CREATE_ASC),
        )  # fmt: skip
        by_name: dict[bytes, list[Any]] = {}
        root = self._slots_root()
        for kv in reply.kvs:
            base, _, _ = kv.key[len(root) :].rpartition(b"/")
            by_name.setdefault(base, []).append(kv)
        entries = []
        now = datetime.now(timezone.utc)
        ttls: dict[int, float] = {}
        for escaped, kvs in by_name.items():
            name = _unescape(escaped)
            for kv, granted in _granted(kvs):
                data = _value(kv)
                info = None
                if granted:
                    if kv.lease not in ttls:
                        ttls[kv.lease] = self._lease_left(name, kv.lease)
                    left = ttls[kv.lease]
                    if left < 0:
                        continue  # ran out between the two reads
                    holder = load_holder(data.get("holder"))
                    info = LockInfo(
                        self.alias, name, int(kv.create_revision), holder, _acquired(holder, now),
                        datetime.fromtimestamp(now.timestamp() + left, timezone.utc), left,
                    )  # fmt: skip
                entries.append(SlotEntry(name, int(data["limit"]), int(data["weight"]), info))
        return entries

    def _lease_left(self, name: str, lease_id: int) -> float:
        reply = self._call(
            name, "lease", "LeaseTimeToLive", rpc.LeaseTimeToLiveRequest(ID=lease_id)
        )
        return float(reply.TTL)

    # --- parked Celery calls ----------------------------------------------------------

    def do_park(self, name: str, key: str, order: int, payload: str) -> None:
        value = json.dumps({"place": order, "payload": payload}).encode()
        self._txn(name, txn([], [put(self._parked_base(name) + _escape(key), 0, value)]))

    def _parked(self, name: str, start: bytes) -> list[tuple[Any, ParkedTask]]:
        reply = self._call(
            name or "*", "kv", "Range", rpc.RangeRequest(key=start, range_end=range_end(start))
        )
        root = self._parked_root()
        found = []
        for kv in reply.kvs:
            escaped_name, _, escaped_key = kv.key[len(root) :].rpartition(b"/")
            data = json.loads(kv.value)
            name_, key = _unescape(escaped_name), _unescape(escaped_key)
            found.append((kv, ParkedTask(name_, key, int(data["place"]), str(data["payload"]))))
        return sorted(found, key=lambda pair: (pair[1].order, pair[1].key))

    def do_unpark(self, name: str, count: int) -> list[ParkedTask]:
        taken: list[ParkedTask] = []
        for kv, parked in self._parked(name, self._parked_base(name)):
            if len(taken) == count:
                break
            reply = self._txn(
                name, txn([created_at(kv.key, kv.create_revision)], [delete(kv.key)])
            )
            if reply.succeeded:
                taken.append(parked)
        return taken

    def do_unpark_key(self, name: str, key: str) -> bool:
        reply = self._txn(name, txn([], [delete(self._parked_base(name) + _escape(key))]))
        return bool(reply.responses[0].response_delete_range.deleted)

    def do_list_parked(self, prefix: str) -> list[ParkedTask]:
        return [p for _, p in self._parked(prefix, self._parked_root() + _escape(prefix))]


def _value(kv: Any) -> dict[str, Any]:
    try:
        data = json.loads(kv.value)
        return {"limit": int(data["limit"]), "weight": int(data["weight"]), **data}
    except (ValueError, KeyError, TypeError):
        return {"limit": 0, "weight": 0}  # not one of ours: it blocks nobody


def _granted(kvs: Any) -> list[tuple[Any, bool]]:
    """Keys in create-revision order, each with whether the weights up to it fit the limit."""
    used, out = 0, []
    for kv in kvs:
        data = _value(kv)
        used += data["weight"]
        out.append((kv, used <= data["limit"]))
    return out


def _acquired(holder: dict[str, Any], default: datetime) -> datetime:
    text = holder.get("acquired_at")
    if isinstance(text, str):
        try:
            value = datetime.fromisoformat(text)
        except ValueError:
            return default
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return default
