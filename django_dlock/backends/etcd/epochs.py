"""Fencing tokens on etcd that never repeat, even after etcd loses its data.

A lock key's create revision orders the grants, but etcd counts revisions
again from 1 on a wiped data dir, and a restore from an older snapshot issues
the revisions after the snapshot a second time. So the token is ``E + r``:
``r`` the key's create revision and ``E`` the **epoch** in force when the key
was created, a wall-clock time in microseconds, as Redis seeds its tokens.

Epochs are keys ``Pdlock-epochs/<E>`` (no lease). Each one's create revision
is where it starts: a key created at revision ``r`` takes the epoch created
last before ``r`` (the first one, for keys older than every epoch). A lock's
token can so be worked out again from its key by anyone (``locks list``,
``break``), and the epochs are read in the transaction that creates the key.

A new epoch ``max(now, E_last + revision + 1)`` is created when:

- there is none: a new cluster, or one whose data dir was wiped. Tokens from
  before counted up from an older clock reading by far fewer than one per
  microsecond, so the new ones are larger.
- etcd was restored from a snapshot. etcd's raft index counts every entry of
  its log, and every revision is one, so a member's raft index is never below
  its revision; a restore starts a new log on the old data, and the revision
  is then above it. The newest epoch is renewed unless it was written in this
  new log (:meth:`Epoch.older_than_the_log`).

A process looks when it first uses the backend, after a call that failed
(a restore stops every member), and when a reply's revision is below one it
saw before; its first acquisition after that waits for the look.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...clocks import wall_micros
from ...exceptions import BackendUnavailable
from . import etcdrpc as rpc
from .transport import Transport, encode_op, get, modified_at, put, range_end, txn


@dataclass(frozen=True)
class Epoch:
    """One epoch: its value, where it starts, and the log position it was written at."""

    value: int
    #: The create revision of its key: keys created after it take this epoch.
    start: int
    raft_index: int
    revision: int

    @property
    def in_a_restored_log(self) -> bool:
        """Written while the revision was above the raft index (after a restore)."""
        return self.raft_index < self.revision

    def older_than_the_log(self, revision: int, raft_index: int) -> bool:
        """Written before the log etcd has now began (etcd said ``revision``, ``raft_index``).

        Every write adds one to both; lease grants, revokes and the like add
        to the raft index only. So within one log ``revision - raft_index``
        never grows, and a log restored from a snapshot starts at the
        snapshot's revision with a small raft index: a larger difference than
        when this epoch was written means the log was replaced since, even if
        this epoch was itself written after an earlier restore.
        """
        if not self.in_a_restored_log or self.raft_index > raft_index:
            return True
        return revision - raft_index > self.revision - self.raft_index


class Epochs:
    """This process's view of one backend's epochs."""

    def __init__(self, key_prefix: str, transport: Transport) -> None:
        self.transport = transport
        self.root = f"{key_prefix}dlock-epochs/".encode()
        self.end = range_end(self.root)
        #: Put with every new epoch: two processes that both find one due create one.
        self.head = self.root + b"head"
        #: The range that reads every epoch: a RequestOp, and encoded for queue_txn.
        self.op = get(self.root, self.end)
        self.encoded = encode_op(self.op)
        self.mutex = threading.Lock()
        #: Transport failures counted when we last looked (-1: never looked).
        self.looked_at = -1
        #: The highest revision a reply showed; one below it means data went back.
        self.high = 0
        self.suspect = False
        self._parsed: tuple[tuple[tuple[int, bytes], ...], list[Epoch]] = ((), [])

    # --- what replies tell ------------------------------------------------------------

    def note(self, revision: int, floor: int) -> None:
        """A reply's header revision; ``floor``, the highest seen when its request was sent.

        A revision below ``floor`` means etcd lost data: etcd's reads and
        writes are linearizable, so a request sent after a reply showed
        revision r is answered at r or later. Below ``high`` alone proves
        nothing: calls of several threads at once come back in any order, and
        a waiter whose put saw a false alarm put its key anew, losing its
        place in the queue to those that queued after it.
        """
        if revision < floor:
            self.suspect = True
        if revision > self.high:
            self.high = revision

    @property
    def due(self) -> bool:
        return self.suspect or self.looked_at != self.transport.failures

    def parse(self, kvs: Any) -> list[Epoch]:
        """The epochs in a range reply, oldest first."""
        # Revisions alone repeat after a wiped data dir; epoch values do not.
        marks = tuple((kv.create_revision, kv.value) for kv in kvs)
        if marks == self._parsed[0]:
            return self._parsed[1]
        epochs = []
        for kv in kvs:
            try:
                data = json.loads(kv.value)
                epochs.append(
                    Epoch(
                        int(data["epoch"]),
                        int(kv.create_revision),
                        int(data["raft_index"]),
                        int(data["revision"]),
                    )
                )
            except (ValueError, KeyError, TypeError):
                continue  # the head, or not one of ours
        epochs.sort(key=lambda e: e.start)
        self._parsed = (marks, epochs)
        return epochs

    @staticmethod
    def epoch_for(epochs: list[Epoch], revision: int) -> int | None:
        """The epoch of a key created at ``revision``; None if there is no epoch."""
        if not epochs:
            return None
        found = epochs[0].value
        for epoch in epochs:
            if epoch.start > revision:
                break
            found = epoch.value
        return found

    # --- looking, and new epochs ------------------------------------------------------

    def read(self, name: str) -> tuple[list[Epoch], int]:
        """The epochs, and the head's mod revision (0: none)."""
        reply = self.transport.request(
            name, "kv", "Range", rpc.RangeRequest(key=self.root, range_end=self.end)
        )
        head = [kv.mod_revision for kv in reply.kvs if kv.key == self.head]
        return self.parse(reply.kvs), int(head[0]) if head else 0

    def look(self, name: str, *, force: bool = False) -> None:
        """If due (or ``force``): create a new epoch if there is none, or etcd was restored."""
        if not (force or self.due):
            return
        with self.mutex:
            if not (force or self.due):
                return
            failures = self.transport.failures
            try:
                revision = self._look(name)
            except BackendUnavailable as e:
                if "permission denied" not in str(e):
                    raise
                raise BackendUnavailable(
                    f"{e} (the etcd user needs read-write on the "
                    f"{self.root.decode()!r} prefix too: fencing tokens are counted from "
                    "the epochs kept there; see docs/backends/etcd.md)",
                    name=name,
                    backend=self.transport.alias,
                    transient=False,
                ) from e
            self.looked_at = failures
            self.suspect = False
            self.high = revision

    def _look(self, name: str) -> int:
        """Read etcd's status and the epochs; create one if due. The revision etcd is at."""
        status = self.transport.request(name, "maintenance", "Status", rpc.StatusRequest())
        epochs, head = self.read(name)
        revision, raft_index = int(status.header.revision), int(status.raftIndex)
        if not epochs:
            self._create(name, head, 0, raft_index, revision)
        elif revision > raft_index and epochs[-1].older_than_the_log(revision, raft_index):
            self._create(name, head, epochs[-1].value, raft_index, revision)
        return revision

    def _create(self, name: str, head: int, last: int, raft_index: int, revision: int) -> None:
        """A new epoch after ``last``, unless another process created one since we read."""
        value = max(wall_micros(), last + revision + 1)
        data = json.dumps({"epoch": value, "raft_index": raft_index, "revision": revision})
        self.transport.request(
            name,
            "kv",
            "Txn",
            txn(
                [modified_at(self.head, head)],
                [
                    put(self.head, 0, b"%d" % value),
                    put(self.root + b"%020d" % value, 0, data.encode()),
                ],
            ),
        )

    def ranged(
        self, call: Callable[..., Any], name: str, request: Any
    ) -> tuple[Any, Callable[[int], int]]:
        """The keys a RangeRequest reads, and their tokens by create revision.

        The epochs are read in the same transaction (one round trip). Looks
        first: after a restore, any process's first use (``locks list``
        included) creates the new epoch.
        """
        self.look(name)
        reply = call(name, "kv", "Txn", txn([], [rpc.RequestOp(request_range=request), self.op]))
        epochs = self.parse(reply.responses[1].response_range.kvs)
        tokens = lambda revision: (self.epoch_for(epochs, revision) or 0) + revision  # noqa: E731
        return reply.responses[0].response_range.kvs, tokens

    def token_of(self, name: str, revision: int) -> int:
        """The token of our key created at ``revision``, read after the fact.

        For a key whose creation read no epoch (the data went after our look),
        or whose creation's reply was lost: look first, which creates an epoch
        if there is none.
        """
        self.look(name, force=True)
        epoch = self.epoch_for(self.read(name)[0], revision)
        if epoch is None:  # the new epoch's transaction failed, and nobody else made one
            raise BackendUnavailable(
                f"etcd has no fencing epoch under {self.root.decode()!r} for lock {name!r} "
                f"on backend {self.transport.alias!r}, and none could be made.",
                name=name,
                backend=self.transport.alias,
            )
        return epoch + revision
