"""The etcd backend's sessions: what one process holds on one backend.

Like Go's ``concurrency.Session``, a process keeps one lease per backend and
TTL and puts the keys of its locks under it; the watchdog keeps it alive
while the process holds locks on it, the waiting thread while it waits, and
:meth:`Sessions.close` revokes it. A second acquisition of the same name
from this process needs its own key, so it takes a second lease of that TTL
(a third, ...). ``renew=False`` gets a lease of its own.

:class:`Sessions` also keeps this process's acquisitions (:class:`Entry`) and
the keys a release could not delete while etcd was unreachable: a session
lease would keep those alive, so they are deleted once etcd answers again.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from ...exceptions import BackendUnavailable
from . import etcdrpc as rpc
from .epochs import Epochs
from .transport import Transport, created_at, delete, delete_txn, leased_by, txn
from .watches import Watches


def lease_seconds(ttl: float) -> int:
    """etcd leases are whole seconds; never shorter than asked."""
    return max(1, math.ceil(ttl))


@dataclass(eq=False)
class Lease:
    """An etcd lease of ours, as this process knows it."""

    id: int
    ttl: int
    #: ``time.monotonic()`` before which the lease cannot have run out on the server.
    expires: float
    #: Granted for one acquisition (``renew=False``, or moved by ``extend``).
    private: bool = False
    #: Lock keys (``Pdlock/N/``) that one of our acquisitions has under this lease.
    names: set[bytes] = field(default_factory=set)
    #: The whole seconds asked for (0: unknown). etcd grants at least its
    #: minimum TTL (1.5 election timeouts: 2 s by default), so ``ttl`` can be more.
    asked: int = 0

    @property
    def seconds(self) -> int:
        """The TTL this lease stands for: what was asked, else what etcd granted."""
        return self.asked or self.ttl


@dataclass(eq=False)
class Entry:
    """One acquisition of ours: queued or holding."""

    base: bytes
    key: bytes
    lease: Lease
    #: Lease whose id names the key (the lease may since have moved).
    slot: Lease
    revision: int = 0
    #: The epoch in force when the key was created (``epochs.py``); None: not read yet.
    epoch: int | None = None


class Sessions:
    """What one process knows: its transport, leases, acquisitions and watches.

    Methods that take ``name`` name that lock in the errors they raise:
    ``BackendUnavailable``, or ``LeaseNotFound`` for a lease etcd no longer has.
    """

    def __init__(self, transport: Transport, epochs: Epochs) -> None:
        self.transport = transport
        self.epochs = epochs
        self.watches = Watches(transport)
        #: Guards ``sessions``, ``entries`` and every lease's ``names``.
        self.mutex = threading.Lock()
        #: TTL in seconds -> this process's session leases of that TTL
        self.sessions: dict[int, list[Lease]] = {}
        #: owner token -> its acquisition
        self.entries: dict[str, Entry] = {}
        #: key -> the compare that identifies our key (its create revision, or
        #: our session lease when the revision is unknown), for keys that a
        #: release or give-up could not delete (etcd unreachable) and that a
        #: session lease would keep alive
        self.orphans: dict[bytes, Any] = {}

    def call(self, name: str, stub: str, method: str, request: Any, **kwargs: Any) -> Any:
        """``Transport.request``; once etcd answers, delete the keys left behind."""
        # The revision replies had shown before this one was sent: a reply of
        # another thread's that came back meanwhile may show a newer one.
        floor = self.epochs.high
        reply = self.transport.request(name, stub, method, request, **kwargs)
        if stub != "maintenance":  # Status is a member's own view, not linearizable
            self.epochs.note(reply.header.revision, floor)
        if self.orphans:
            # etcd answers again: finish the releases that could not reach it.
            self._sweep_orphans()
        return reply

    def close(self) -> None:
        """Revoke every lease (held locks are released at once) and disconnect."""
        self.watches.close()
        # Do not hang an exiting process on an unreachable cluster.
        self.transport.timeout = min(self.transport.timeout, 1.0)
        with self.mutex:
            # Lease compares by identity: a set holds each lease once.
            leases = {lease for ss in self.sessions.values() for lease in ss}
            leases.update(entry.lease for entry in self.entries.values())
            self.sessions.clear()
            self.entries.clear()
        for lease in leases:
            with contextlib.suppress(grpc.RpcError):  # it runs out by itself
                self.transport.call("lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease.id))
        self.transport.close()

    # --- leases -----------------------------------------------------------------------

    def grant(self, name: str, seconds: int, private: bool) -> Lease:
        """A new lease of ``seconds``."""
        sent = time.monotonic()
        reply = self.call(name, "lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=seconds))
        if reply.error:
            alias = self.transport.alias
            raise BackendUnavailable(
                f"etcd refused a lease for lock {name!r} on backend {alias!r}: {reply.error}",
                name=name,
                backend=alias,
            )
        return Lease(int(reply.ID), int(reply.TTL), sent + int(reply.TTL), private, asked=seconds)

    def keepalive(self, name: str, lease: Lease) -> bool:
        """Refresh ``lease``; False if it had already run out."""
        sent = time.monotonic()
        try:
            ttl = self.transport.keepalive(lease.id)
        except grpc.RpcError as e:
            raise self.transport.unavailable(name, e) from e
        if ttl <= 0:
            lease.expires = 0.0
            return False
        lease.ttl = ttl
        lease.expires = max(lease.expires, sent + ttl)
        return True

    def revoke_quietly(self, lease: Lease) -> None:
        """Revoke ``lease``; if etcd does not answer, it runs out by itself."""
        # Not found (it ran out) or unreachable: it runs out by itself.
        with contextlib.suppress(grpc.RpcError):
            self.transport.call("lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease.id))

    def take_slot(self, name: str, base: bytes, ttl: float, renew: bool) -> Lease:
        """A lease under which ``base`` has no key of ours yet, fresh enough for ``ttl``."""
        whole = lease_seconds(ttl)
        if not renew:
            lease = self.grant(name, whole, private=True)
            lease.names.add(base)
            return lease
        while True:
            now = time.monotonic()
            stale: Lease | None = None
            with self.mutex:
                sessions = self.sessions.setdefault(whole, [])
                for lease in sessions:
                    if base in lease.names:
                        continue
                    if lease.expires - now < ttl / 2:
                        stale = stale or lease
                        continue
                    lease.names.add(base)
                    return lease
                if stale is not None:
                    # Claim it while it is refreshed, so another thread takes another.
                    stale.names.add(base)
            if stale is None:
                lease = self.grant(name, whole, private=False)
                with self.mutex:
                    lease.names.add(base)
                    self.sessions.setdefault(whole, []).append(lease)
                return lease
            try:
                alive = stale.expires > time.monotonic() and self.keepalive(name, stale)
            except BaseException:
                self.free_slot(stale, base)
                raise
            if alive:
                return stale
            self.free_slot(stale, base)
            self.drop_session(stale)

    def drop_session(self, lease: Lease) -> None:
        """Take a session lease that ran out, or was revoked, out of reuse."""
        with self.mutex:
            # Listed under the TTL asked for, which etcd may have raised.
            for sessions in self.sessions.values():
                if lease in sessions:
                    sessions.remove(lease)

    def free_slot(self, lease: Lease, base: bytes) -> None:
        """``base`` has no key of ours under ``lease`` any more."""
        with self.mutex:
            lease.names.discard(base)

    # --- acquisitions -------------------------------------------------------------------

    def forget(self, owner: str, *, revoke: bool = True) -> Entry | None:
        """Drop ``owner``'s acquisition; revoke its lease if it had one of its own."""
        with self.mutex:
            entry = self.entries.pop(owner, None)
            if entry is not None:
                entry.slot.names.discard(entry.base)
        if revoke and entry is not None and entry.lease.private:
            self.revoke_quietly(entry.lease)
        return entry

    def delete_entry(self, name: str, entry: Entry, **kwargs: Any) -> Any:
        """Delete our key if it is still the one we created; revoke a lease of its own."""
        try:
            return self.call(
                name, "raw_kv", "Txn", delete_txn(entry.key, entry.revision), **kwargs
            )
        except BackendUnavailable:
            if not entry.lease.private:
                # The session lease would keep the key alive: delete it later.
                self.orphans[entry.key] = created_at(entry.key, entry.revision)
            raise
        finally:
            if entry.lease.private:
                self.revoke_quietly(entry.lease)

    def delete_unknown(self, key: bytes, lease: Lease) -> None:
        """Delete ``key`` if our ``lease`` holds it; quietly, later if etcd is unreachable."""
        ours = leased_by(key, lease.id)
        try:
            self.transport.call("kv", "Txn", txn([ours], [delete(key)]))
        except grpc.RpcError:
            self.orphans[key] = ours

    def _sweep_orphans(self) -> None:
        """Delete keys that an earlier release could not; quietly, stopping at an error."""
        orphans = self.orphans
        for key, ours in list(orphans.items()):
            try:
                self.transport.call("kv", "Txn", txn([ours], [delete(key)]))
            except grpc.RpcError:
                return  # unreachable again; the next call that gets through tries again
            orphans.pop(key, None)
