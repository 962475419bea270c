"""The watchdog's batched renewals on etcd: one keepalive per lease, one read per batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ...exceptions import BackendUnavailable
from ..types import extend_each
from .sessions import Entry, Sessions, lease_seconds
from .transport import get, txn


class EtcdRenewals:
    """``do_extend_many`` for :class:`~.backend.EtcdBackend`: a mixin, as its semaphores are.

    Keys renewed by the watchdog share this process's session leases, so a
    batch costs one ``LeaseKeepAlive`` per session lease in it (usually one)
    and one transaction that reads every key, to find the ones that were
    broken or ran out: two round trips for up to ``renew_batch`` leases.
    """

    #: etcd refuses a transaction of more than 128 operations (``--max-txn-ops``).
    renew_batch: ClassVar[int] = 128

    if TYPE_CHECKING:  # the backend's, which this class is mixed into

        @property
        def state(self) -> Sessions: ...
        def do_extend(self, name: str, owner: str, ttl: float) -> bool: ...
        def _txn(self, name: str, request: Any, **kwargs: Any) -> Any: ...

    def do_extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]:
        results: list[bool | Exception] = [False] * len(leases)
        kept: dict[int, bool | Exception] = {}  # session lease id -> its keepalive
        reads: list[tuple[int, str, Entry]] = []
        for i, (name, owner, ttl) in enumerate(leases):
            entry = self.state.entries.get(owner)
            if entry is None:
                continue
            if lease_seconds(ttl) > entry.lease.seconds:  # a longer TTL: the key moves leases
                results[i] = extend_each(self.do_extend, [leases[i]])[0]
                continue
            # A shorter TTL is a renewal sent before a hand extend() moved the
            # key onto a longer lease: keeping that lease alive keeps the key
            # at least as long; moving it back would undo the extend (issue
            # 28). The handle counts the shorter TTL it sent.
            lease_id = entry.lease.id
            if lease_id not in kept:
                try:
                    kept[lease_id] = self.state.keepalive(name, entry.lease)
                except BackendUnavailable as e:
                    kept[lease_id] = e
            alive = kept[lease_id]
            if alive is True:
                reads.append((i, owner, entry))
            elif alive is False:
                self.state.forget(owner)
            else:
                results[i] = alive
        if not reads:
            return results
        request = txn([], [get(entry.key, keys_only=True) for _, _, entry in reads])
        try:
            reply = self._txn(leases[reads[0][0]][0], request)
        except BackendUnavailable as e:
            for i, _, _ in reads:
                results[i] = e
            return results
        for (i, owner, entry), response in zip(reads, reply.responses, strict=True):
            kvs = response.response_range.kvs
            if kvs and kvs[0].create_revision == entry.revision:
                results[i] = True
            else:
                self.state.forget(owner)
        return results
