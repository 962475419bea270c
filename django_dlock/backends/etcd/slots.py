"""The etcd backend's semaphores, read/write locks and parked Celery calls.

Keys, for ``KEY_PREFIX`` P, semaphore N (escaped as lock names are) and the
acquisition's owner token O::

    Pdlock-slots/N/O     value: {"limit", "weight", "holder", "acquired_us"};
                         attached to the session lease (renew=True), as a
                         mutex's key is, or to a lease of its own (renew=False)
    Pdlock-parked/N/C    value: {"order", "payload"}; no lease (Celery call id C)

They live outside ``Pdlock/``, so the mutexes' listing never reads them, and
``etcdctl lock`` never meets them. A key is named by its owner token, not by
its lease, so one session lease can hold any number of slots of one name.

The semaphore is a queue, as the mutex is (etcd's ``concurrency.Mutex``): an
acquisition puts its key once (``create_revision == 0``), and its key's create
revision orders it among the others. Key i is granted when the weights of the
keys up to and including it, in create-revision order, fit in the limit:
strictly first come, first served, so a waiting writer (weight == limit)
holds back every reader behind it. Once granted, a key stays granted while
it exists (keys ahead of it only go, keys behind it do not count), so the
granted keys are always a prefix of the queue and their weights fit. The
fencing token is the key's create revision plus its epoch (``epochs.py``):
grants follow revision order, so tokens increase per name.

A refused key stays in the queue as a waiter. The waiter watches the
semaphore's range for deletes after the revision at which it looked (any key
ahead of it that goes may grant it), at most a third of its TTL at a time;
its key goes when it gives up, or with its lease if it dies.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ...clocks import wall_micros
from ...exceptions import BackendUnavailable
from ..attempts import Attempt
from ..base import (
    Grant,
    LockInfo,
    ParkedTask,
    SlotEntry,
    load_holder,
    micros_to_datetime,
)
from ..ops import SlotAttempt
from ..parking_backend import ParkingBackend
from ..semaphore_backend import SemaphoreBackend
from . import etcdrpc as rpc
from .sessions import Entry, Sessions
from .transport import (
    CREATE_ASC,
    LeaseNotFound,
    created_at,
    delete,
    escape,
    get,
    modified_at,
    put,
    range_end,
    txn,
    unescape,
)

#: How often ``do_unpark`` reads the queue again after a call it was taking
#: was parked again meanwhile (each time, some other process changed it).
UNPARK_ROUNDS = 5

#: What one try of a slot learns: the token, a Grant or None (refused); and the
#: revision at which it looked (0: try again at once, without waiting).
Outcome = tuple[int | Grant | None, int]


class EtcdSlotAttempt(SlotAttempt):
    """One acquisition of a slot: its key is queued once, and waiting watches the range.

    The queue entry is the backend's, kept under the owner (``state.entries``)
    as the mutex's is, so that release, extend and check find it.
    """

    #: The revision at which the last try looked (0: try again at once).
    revision: int = 0
    backend: EtcdSlots

    def try_acquire(self) -> int | Grant | None:
        result, self.revision = self.backend.try_slot(
            self.name, self.owner, self.ttl, self.holder[1], self.renew, self.limit, self.weight
        )
        return result

    def wait(self, remaining: float | None) -> None:
        if not self.revision:
            return  # our key went: queue again now
        # A third of the TTL at most, so that the next try keeps our lease alive.
        bound = self.ttl / 3
        timeout = bound if remaining is None else min(remaining, bound)
        if timeout > 0:
            self.backend.watch_slots(self.name, self.revision, timeout, self)


class EtcdSlots(SemaphoreBackend, ParkingBackend):
    """The ``*_slot`` and parking primitives of :class:`~.backend.EtcdBackend`."""

    supports_fair_semaphores = True
    slot_attempt_class = EtcdSlotAttempt

    if TYPE_CHECKING:  # the backend's, which this class is mixed into
        root: bytes

        @property
        def state(self) -> Sessions: ...
        def _call(self, name: str, stub: str, method: str, request: Any, **kw: Any) -> Any: ...
        def _txn(self, name: str, request: Any, **kwargs: Any) -> Any: ...
        def _granted(
            self, name: str, entry: Entry, ttl: float, started: float | None
        ) -> int | Grant: ...

    def _slots_root(self) -> bytes:
        return self.root[:-1] + b"-slots/"

    def _parked_root(self) -> bytes:
        return self.root[:-1] + b"-parked/"

    def _slots_base(self, name: str) -> bytes:
        return self._slots_root() + escape(name) + b"/"

    def _parked_base(self, name: str) -> bytes:
        return self._parked_root() + escape(name) + b"/"

    # --- the queue ----------------------------------------------------------------------

    def try_slot(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> Outcome:
        """One try: queue ``owner``'s key on the first, look at the queue again on later ones."""
        entry = self.state.entries.get(owner)
        if entry is None:
            return self._enqueue(name, owner, ttl, holder, renew, limit, weight)
        return self._look(name, owner, entry, ttl, limit)

    def _enqueue(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> Outcome:
        """Put ``owner``'s key at the back of the queue and read the queue, in one transaction."""
        state = self.state
        base = self._slots_base(name)
        key = base + owner.encode()
        value = json.dumps(
            {"limit": limit, "weight": weight, "holder": holder, "acquired_us": wall_micros()}
        ).encode()
        state.epochs.look(name)
        for _ in range(2):
            started = time.monotonic()
            # The key names itself in the lease's names: any number of them fit one lease.
            lease = state.take_slot(name, key, ttl, renew)
            entry = Entry(key, key, lease, lease)
            with state.mutex:
                state.entries[owner] = entry
            retried: list[bool] = []
            request = txn(
                [created_at(key, 0)],
                [
                    put(key, lease.id, value),
                    get(base, range_end(base), **CREATE_ASC),
                    state.epochs.op,
                ],
                [get(key, keys_only=True)],
            )
            try:
                reply = self._txn(name, request, ambiguous=retried)
            except LeaseNotFound:
                # Revoked behind our back, or etcd lost its data: use a new lease.
                lease.expires = 0.0
                state.forget(owner)
                state.drop_session(lease)
                continue
            except BaseException:
                state.forget(owner)  # revokes a lease of its own, and the key with it
                if not lease.private:
                    # The put may have been applied: the session lease would keep it.
                    state.delete_unknown(key, lease)
                raise
            if reply.succeeded and state.epochs.suspect:
                # etcd went back (a restore): put our key anew after a look.
                # Its create revision is the reply's (the delete compares it).
                entry.revision = reply.header.revision
                self.do_leave_slot(name, owner)
                if lease.private:
                    state.revoke_quietly(lease)
                state.epochs.look(name)
                continue
            if reply.succeeded:
                entry.revision = reply.header.revision
                entry.epoch = state.epochs.epoch_for(
                    state.epochs.parse(reply.responses[2].response_range.kvs), entry.revision
                )
                kvs = reply.responses[1].response_range.kvs
                return self._evaluate(name, owner, entry, ttl, limit, kvs, reply, started)
            [kv] = reply.responses[0].response_range.kvs or [None]
            if kv is not None and kv.lease == lease.id:
                # Our put was applied by the try that failed over: the key is ours.
                entry.revision = kv.create_revision
                return self._look(name, owner, entry, ttl, limit)
            state.forget(owner)
            raise BackendUnavailable(
                f"etcd key {key!r} for semaphore {name!r} on backend {self.alias!r} "
                "was put by someone else.",
                name=name,
                backend=self.alias,
            )
        raise BackendUnavailable(
            f"etcd revoked every lease given for semaphore {name!r} on backend {self.alias!r}.",
            name=name,
            backend=self.alias,
        )

    def _look(self, name: str, owner: str, entry: Entry, ttl: float, limit: int) -> Outcome:
        """A later try: is our key still queued, and do the weights up to it fit now?"""
        state = self.state
        lease = entry.lease
        if lease.expires - time.monotonic() < lease.ttl / 2 and not state.keepalive(name, lease):
            # Our lease ran out, and our key with it: queue again at the back.
            state.forget(owner)
            if not lease.private:
                state.drop_session(lease)
            return None, 0
        base = self._slots_base(name)
        reply = self._txn(
            name,
            txn(
                [created_at(entry.key, entry.revision)],
                # Our key and those ahead of it: the ones behind do not count.
                [get(base, range_end(base), max_create_revision=entry.revision, **CREATE_ASC)],
            ),
        )
        if not reply.succeeded:
            # Our key went (its lease ran out, or it was broken): queue again at the back.
            state.forget(owner)
            return None, 0
        kvs = reply.responses[0].response_range.kvs
        return self._evaluate(name, owner, entry, ttl, limit, kvs, reply, None)

    def _evaluate(
        self,
        name: str,
        owner: str,
        entry: Entry,
        ttl: float,
        limit: int,
        kvs: Any,
        reply: Any,
        started: float | None,
    ) -> Outcome:
        """Granted if the weights up to and including our key fit in ``limit``."""
        used = 0
        for kv in kvs:
            data = _value(kv)
            if data is None:
                continue  # not one of ours: it holds nothing
            if data["limit"] != limit:
                self.do_leave_slot(name, owner)
                raise self.limit_mismatch(name, limit, data["limit"])
            used += data["weight"]
            if kv.create_revision == entry.revision:
                break
        if used > limit:
            return None, int(reply.header.revision)
        return self._granted(name, entry, ttl, started), 0

    def watch_slots(self, name: str, revision: int, timeout: float, attempt: Attempt) -> None:
        """Wait for a delete under ``name``'s keys after ``revision``, ``timeout``, or a stop."""
        base = self._slots_base(name)
        watches = self.state.watches
        wake = watches.watch(base, revision + 1, range_end(base))
        attempt.waking = wake.event
        try:
            if not attempt.stopped:
                wake.event.wait(timeout)
        finally:
            attempt.waking = None
            watches.cancel(wake)

    # --- the primitives -----------------------------------------------------------------

    def do_acquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> int | Grant | None:
        return self.try_slot(name, owner, ttl, holder, renew, limit, weight)[0]

    def do_leave_slot(self, name: str, owner: str) -> None:
        entry = self.state.forget(owner, revoke=False)
        if entry is not None:
            self.state.delete_entry(name, entry)

    # A held slot is an entry under its owner like a held mutex: released,
    # extended (kept alive, or moved to a lease of another TTL) and checked
    # by the mutex's own primitives.

    def do_release_slot(self, name: str, owner: str) -> bool:
        return self.do_release(name, owner)

    def do_extend_slot(self, name: str, owner: str, ttl: float) -> bool:
        return self.do_extend(name, owner, ttl)

    def do_check_slot(self, name: str, owner: str) -> bool:
        return self.do_check(name, owner)

    def do_break_slot(self, name: str, token: int | None) -> int:
        base = self._slots_base(name)
        kvs, tokens = self.state.epochs.ranged(
            self._call, name, rpc.RangeRequest(key=base, range_end=range_end(base), **CREATE_ASC)
        )
        freed = 0
        for kv, granted in _queue(kvs):
            if not granted or token not in (None, tokens(kv.create_revision)):
                continue
            # Only if it is still that key: a holder that released meanwhile
            # and queued again has a key of another revision.
            deleted = self._txn(
                name, txn([created_at(kv.key, kv.create_revision)], [delete(kv.key)])
            )
            freed += bool(deleted.succeeded)
        return freed

    def do_list_slots(self, prefix: str) -> list[SlotEntry]:
        root = self._slots_root()
        start = root + escape(prefix)
        kvs, tokens = self.state.epochs.ranged(
            self._call,
            prefix or "*",
            rpc.RangeRequest(key=start, range_end=range_end(start), **CREATE_ASC),
        )
        by_name: dict[bytes, list[Any]] = {}
        for kv in kvs:
            escaped, _, _ = kv.key[len(root) :].rpartition(b"/")
            by_name.setdefault(escaped, []).append(kv)
        entries = []
        now = datetime.now(timezone.utc)
        ttls: dict[int, float] = {}
        for escaped, kvs in by_name.items():
            name = unescape(escaped)
            for kv, granted in _queue(kvs):
                data = _value(kv)
                if data is None:
                    continue
                info = None
                if granted:
                    if kv.lease not in ttls:
                        ttls[kv.lease] = self._lease_left(name, kv.lease)
                    left = ttls[kv.lease]
                    if left < 0:
                        continue  # ran out between the two reads
                    info = LockInfo(
                        backend=self.alias,
                        name=name,
                        token=tokens(int(kv.create_revision)),
                        holder=load_holder(data.get("holder")),
                        acquired_at=_acquired(data, now),
                        expires_at=datetime.fromtimestamp(now.timestamp() + left, timezone.utc),
                        expires_in=left,
                    )
                entries.append(SlotEntry(name, data["limit"], data["weight"], info))
        return entries

    def _lease_left(self, name: str, lease_id: int) -> float:
        """Seconds lease ``lease_id`` has left by etcd's clock (negative: gone)."""
        reply = self._call(
            name, "lease", "LeaseTimeToLive", rpc.LeaseTimeToLiveRequest(ID=lease_id)
        )
        return float(reply.TTL)

    # --- parked Celery calls ----------------------------------------------------------

    def do_park(self, name: str, key: str, order: int, payload: str) -> None:
        value = json.dumps({"order": order, "payload": payload}).encode()
        request = rpc.PutRequest(key=self._parked_base(name) + escape(key), value=value)
        self._call(name, "kv", "Put", request)

    def _parked(self, name: str, start: bytes) -> list[tuple[Any, ParkedTask]]:
        """The parked calls under ``start``, smallest order first."""
        reply = self._call(
            name or "*", "kv", "Range", rpc.RangeRequest(key=start, range_end=range_end(start))
        )
        root = self._parked_root()
        found = []
        for kv in reply.kvs:
            escaped_name, _, escaped_key = kv.key[len(root) :].rpartition(b"/")
            try:
                data = json.loads(kv.value)
                order, payload = int(data["order"]), str(data["payload"])
            except (ValueError, KeyError, TypeError):
                continue  # not one of ours
            parked = ParkedTask(unescape(escaped_name), unescape(escaped_key), order, payload)
            found.append((kv, parked))
        return sorted(found, key=lambda pair: (pair[1].order, pair[1].key))

    def do_unpark(self, name: str, count: int) -> list[ParkedTask]:
        """Take the ``count`` calls of smallest order, each only as it was read.

        Each delete compares the key's mod revision with the one read: t0 we
        read call C, t1 C is parked again with a new payload, t2 our delete
        fails, and we read the queue again rather than hand out C's old
        payload and drop its new one. A call that another process took
        meanwhile is skipped.
        """
        taken: list[ParkedTask] = []
        base = self._parked_base(name)
        for _ in range(UNPARK_ROUNDS):
            changed = False
            for kv, parked in self._parked(name, base):
                if len(taken) == count:
                    return taken
                reply = self._txn(
                    name,
                    txn(
                        [modified_at(kv.key, kv.mod_revision)],
                        [delete(kv.key)],
                        [get(kv.key, keys_only=True)],
                    ),
                )
                if reply.succeeded:
                    taken.append(parked)
                elif reply.responses[0].response_range.kvs:
                    changed = True  # parked again since we read it: read again
                    break
            if not changed:
                break
        return taken

    def do_unpark_key(self, name: str, key: str) -> bool:
        request = rpc.DeleteRangeRequest(key=self._parked_base(name) + escape(key))
        return bool(self._call(name, "kv", "DeleteRange", request).deleted)

    def do_list_parked(self, prefix: str) -> list[ParkedTask]:
        return [p for _, p in self._parked(prefix, self._parked_root() + escape(prefix))]


def _value(kv: Any) -> dict[str, Any] | None:
    """A slot key's value; None for a key that is not one of ours."""
    try:
        data = json.loads(kv.value)
        return {**data, "limit": int(data["limit"]), "weight": int(data["weight"])}
    except (ValueError, KeyError, TypeError):
        return None


def _queue(kvs: Any) -> list[tuple[Any, bool]]:
    """Keys in create-revision order, each with whether the weights up to it fit its limit."""
    used, out = 0, []
    for kv in kvs:
        data = _value(kv)
        if data is None:
            out.append((kv, False))
            continue
        used += data["weight"]
        out.append((kv, used <= data["limit"]))
    return out


def _acquired(data: dict[str, Any], default: datetime) -> datetime:
    """When the key was put, by the acquirer's clock (etcd keys carry no time)."""
    micros = data.get("acquired_us")
    if isinstance(micros, int) and not isinstance(micros, bool):
        return micros_to_datetime(micros)
    return default
