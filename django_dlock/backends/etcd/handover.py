"""Handing a held etcd lease to another process: :class:`EtcdHandover`.

``HeldLock.detach()`` moves the key under a lease of its own, named in the
ticket; ``adopt()`` moves it from that lease to one of the adopter's, in one
transaction that compares the key's lease, so that one ticket is adopted at
most once; a ticket nobody adopts is released by the same comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...exceptions import LockNotOwned
from .sessions import Entry, Lease, Sessions, lease_seconds
from .transport import created_at, delete, get, leased_by, put, txn


class EtcdHandover:
    """``do_detach``, ``do_adopt`` and ``do_release_ticket`` of :class:`~.backend.EtcdBackend`."""

    if TYPE_CHECKING:  # the backend's, which this class is mixed into
        alias: str
        _names: Callable[[str], tuple[bytes, bytes, bytes]]

        @property
        def state(self) -> Sessions: ...
        def _txn(self, name: str, request: Any, **kwargs: Any) -> Any: ...
        def _move(self, name: str, owner: str, entry: Entry, seconds: int) -> bool: ...

    def do_detach(self, name: str, owner: str) -> dict[str, Any]:
        entry = self.state.entries.get(owner)
        if entry is None:
            raise LockNotOwned(
                f"Lock {name!r} on backend {self.alias!r} is not held by this process.",
                name=name,
                backend=self.alias,
            )
        if not entry.lease.private and not self._move(name, owner, entry, entry.lease.ttl):
            # The session lease is kept alive for this process's other locks;
            # the key must go under a lease that runs out without us.
            raise LockNotOwned(
                f"Lock {name!r} on backend {self.alias!r} was lost before it could be detached.",
                name=name,
                backend=self.alias,
            )
        self.state.forget(owner, revoke=False)
        if not entry.slot.private:
            # The key is still named after this session lease, and may live on
            # in an adopter: keep the name taken, so that a later acquisition
            # here puts a key of another name instead of finding this one.
            with self.state.mutex:
                entry.slot.names.add(entry.base)
        return {
            "key": entry.key.hex(),
            "revision": entry.revision,
            "lease": entry.lease.id,
            "lease_ttl": entry.lease.ttl,
        }

    def _ticket(self, name: str, state: Any) -> tuple[bytes, bytes, int, int]:
        """A ticket's lock base, key, create revision and the lease it was handed over on."""
        try:
            key = bytes.fromhex(state["key"])
            revision, lease_id = int(state["revision"]), int(state["lease"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Malformed etcd lease ticket state {state!r}: {e}") from e
        base = self._names(name)[0]
        if not key.startswith(base):
            raise ValueError(f"The ticket's etcd key {key!r} is not under lock {name!r}.")
        return base, key, revision, lease_id

    def do_adopt(self, name: str, owner: str, new_owner: str, ttl: float, state: Any) -> bool:
        """Move the key from the ticket's lease to a new lease of the adopter's.

        ``do_detach`` put the key under a lease of its own, named in the ticket.
        The move compares the key's lease with that one, so the first adopter
        wins and a second finds the key under another lease and is refused.
        """
        base, key, revision, ticket_lease = self._ticket(name, state)
        lease = self.state.grant(name, lease_seconds(ttl), private=True)
        retried: list[bool] = []
        try:
            reply = self._txn(
                name,
                txn(
                    [created_at(key, revision), leased_by(key, ticket_lease)],
                    [put(key, lease.id)],
                    [get(key, keys_only=True)],
                ),
                ambiguous=retried,
            )
        except BaseException:
            self.state.revoke_quietly(lease)
            raise
        moved = bool(reply.succeeded)
        if not moved and retried:
            # The try that failed over may have moved it for us.
            [kv] = reply.responses[0].response_range.kvs or [None]
            moved = kv is not None and kv.create_revision == revision and kv.lease == lease.id
        if not moved:
            self.state.revoke_quietly(lease)
            return False
        self.state.revoke_quietly(Lease(ticket_lease, 0, 0.0, private=True))
        with self.state.mutex:
            self.state.entries[new_owner] = Entry(base, key, lease, lease, revision)
        return True

    def do_release_ticket(self, name: str, owner: str, state: Any) -> bool:
        _, key, revision, ticket_lease = self._ticket(name, state)
        retried: list[bool] = []
        reply = self._txn(
            name,
            txn(
                [created_at(key, revision), leased_by(key, ticket_lease)],
                [delete(key)],
                [get(key, keys_only=True)],
            ),
            ambiguous=retried,
        )
        self.state.revoke_quietly(Lease(ticket_lease, 0, 0.0, private=True))
        # A try that failed over may have deleted it: then the key is gone.
        if reply.succeeded:
            return True
        return bool(retried) and not reply.responses[0].response_range.kvs
