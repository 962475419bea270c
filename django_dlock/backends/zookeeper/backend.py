"""ZooKeeperBackend: see the package docstring for the recipe and the node layout."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import (
    NodeExistsError,
    NoNodeError,
)

from ..base import Attempt, BackendUnavailable, Grant, load_holder
from .operations import ZooKeeperOperations, with_ttl
from .paths import ERRORS, NODE_MARK, WAIT_CAP
from .session import Held

logger = logging.getLogger("django_dlock")


class ZooKeeperAttempt(Attempt):
    """An acquisition queued as a node in the lock's directory; waits watch the node ahead."""

    backend: ZooKeeperBackend
    #: Our node's full path and czxid, once created.
    node: str | None = None
    czxid: int = 0
    session: int | None = None
    #: Did a create reach the service, perhaps unanswered? Then look for our node first.
    create_sent: bool = False
    #: The node just ahead of ours at the last refusal.
    ahead: str | None = None

    def try_acquire(self) -> int | Grant | None:
        return self.backend._try_acquire(self)

    def wait(self, remaining: float | None) -> None:
        self.backend._wait_ahead(self, remaining)

    def abandon(self) -> None:
        self.backend._leave_queue(self)

    def interrupt(self) -> None:
        event = self.waking
        if event is not None:
            event.set()


class ZooKeeperBackend(ZooKeeperOperations):
    """Locks in ZooKeeper; see the package docstring for the recipe and the layout."""

    attempt_class = ZooKeeperAttempt

    # --- acquire --------------------------------------------------------------------------

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        attempt = self.ops().attempt(name, owner, ttl, (load_holder(holder), holder), renew, None)
        assert isinstance(attempt, ZooKeeperAttempt)
        result = self._try_acquire(attempt)
        if result is None:
            self._leave_queue(attempt)
        return result

    def _try_acquire(self, attempt: ZooKeeperAttempt) -> int | Grant | None:
        name = attempt.name
        directory = self._dir(name)
        client = self.client
        try:
            if attempt.node is None and attempt.create_sent:
                # A create whose reply we missed may have landed: look for it first.
                self._find_node(attempt, directory)
            if attempt.node is not None and attempt.session != self._session():
                attempt.node = None  # its session expired: that node is gone
            if attempt.node is None:
                children = self._create(attempt, directory, client)
            else:
                children = self.zk.get_children(directory)
        except NoNodeError:
            children = []
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        mine = attempt.node.rsplit("/", 1)[1] if attempt.node else None
        mark = attempt.owner + NODE_MARK
        ghosts = [c for c in children if c.startswith(mark) and c != mine]
        if ghosts:
            # A create of this attempt that went unanswered, and landed after all:
            # left there, it would stand in the queue for as long as our session.
            for ghost in ghosts:
                self._delete(name, f"{directory}/{ghost}")
            children = [c for c in children if c not in ghosts]
        if mine not in children:
            attempt.node = None  # broken, or gone with a session: queue again
            return None
        contenders = self._contenders(children)
        ours = next(i for i, (_, child) in enumerate(contenders) if child == mine)
        if ours:
            attempt.ahead = f"{directory}/{contenders[ours - 1][1]}"
            return None
        attempt.ahead = None
        return self._granted(attempt)

    def _create(self, attempt: ZooKeeperAttempt, directory: str, client: KazooClient) -> list[str]:
        """Create our node and read the children behind it, pipelined: one round trip."""
        data = attempt.holder[1].encode()
        prefix = f"{directory}/{attempt.owner}{NODE_MARK}"
        for _ in range(3):
            attempt.create_sent = True
            sent = time.monotonic()
            created = client.create_async(
                prefix, data, ephemeral=True, sequence=True, include_data=True
            )
            listed = client.get_children_async(directory)
            with self._mutex:
                self._waiting.add(attempt.owner)
            try:
                # The listing comes back after the create (one session's requests
                # are answered in order): waiting on it first wakes us once.
                with contextlib.suppress(NoNodeError):
                    listed.wait(timeout=self.timeout)
                path, stat = created.get(timeout=self.timeout)
            except ERRORS as e:
                if not isinstance(e, NoNodeError):
                    # It may land later, after this attempt has stopped looking.
                    self._unsure_create(directory, attempt.owner)
                    raise
                # NoNodeError: the lock's directory is missing; make it.
                with contextlib.suppress(NoNodeError):
                    listed.get(timeout=self.timeout)
                with contextlib.suppress(NodeExistsError):
                    self.zk.ensure_path(directory)
                continue
            self._heard(sent, int(stat.ephemeralOwner))
            # The session that owns it, from the server: kazoo may have moved to a new
            # session while the create was in flight (the old one expired).
            attempt.node, attempt.czxid = path, int(stat.czxid)
            attempt.session = int(stat.ephemeralOwner)
            children: list[str] = listed.get(timeout=self.timeout)
            return children
        raise NoNodeError(directory)

    def _find_node(self, attempt: ZooKeeperAttempt, directory: str) -> None:
        try:
            # A follower may not have applied our create yet: read what the leader has.
            children = self.zk.synced_children(directory)
        except NoNodeError:
            return
        mark = attempt.owner + NODE_MARK
        for child in children:
            if child.startswith(mark):
                path = f"{directory}/{child}"
                stat = self.zk.exists(path)
                if stat is not None:
                    attempt.node, attempt.czxid = path, int(stat.czxid)
                    attempt.session = int(stat.ephemeralOwner)
                return

    def _granted(self, attempt: ZooKeeperAttempt) -> int:
        assert attempt.node is not None
        expires = time.monotonic() + attempt.ttl
        held = Held(
            attempt.name, attempt.node, attempt.czxid, expires, attempt.session, attempt.holder[1]
        )
        with self._mutex:
            self._waiting.discard(attempt.owner)
            self._held[attempt.owner] = held
            self._sweep.pop(self._dir(attempt.name), None)
            self._keep()
        if not attempt.renew:
            self._expire_at(attempt.owner, held)
        attempt.node = None
        return attempt.czxid

    def _wait_ahead(self, attempt: ZooKeeperAttempt, remaining: float | None) -> None:
        """Until the node ahead of ours goes (its watch), or ``remaining`` runs out."""
        ahead = attempt.ahead
        if ahead is None or attempt.stopped:
            return
        event = attempt.waking = threading.Event()
        try:
            if self.zk.exists(ahead, watch=lambda _event: event.set()) is None:
                return
        except ERRORS as e:
            raise self._unavailable(attempt.name, e) from e
        cap = WAIT_CAP if remaining is None else min(remaining, WAIT_CAP)
        event.wait(max(0.0, cap))

    def _leave_queue(self, attempt: ZooKeeperAttempt) -> None:
        """Delete our node; one whose create went unanswered is looked for by its prefix.

        If ZooKeeper does not answer, the node is deleted once it does (``_tidy``):
        a waiter's node left behind would stand at the head of the queue for as
        long as this process's session lives.
        """
        node, attempt.node, attempt.ahead = attempt.node, None, None
        with self._mutex:
            self._waiting.discard(attempt.owner)
        if node is None and attempt.create_sent:
            node = f"{self._dir(attempt.name)}/{attempt.owner}{NODE_MARK}"
        if node is not None:
            try:
                self._delete(attempt.name, node)
            except BackendUnavailable:
                logger.debug("Leaving the queue of %r failed", attempt.name, exc_info=True)

    # --- release, extend, check -----------------------------------------------------------

    def do_release(self, name: str, owner: str) -> bool:
        with self._mutex:
            held = self._held.pop(owner, None)
        if held is None or held.name != name:
            # Not ours here (a ticket, an unknown outcome): our node by its prefix.
            return self._delete(name, f"{self._dir(name)}/{owner}{NODE_MARK}")
        if held.expires <= time.monotonic():
            # Ran out here before the release: the lease had ended (the node goes now).
            with contextlib.suppress(BackendUnavailable):
                self._delete(name, held.path)
            return False
        return self._delete(name, held.path)

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        return self._extend(name, owner, ttl, time.monotonic())

    def _extend(self, name: str, owner: str, ttl: float, sent: float) -> bool:
        with self._mutex:
            held = self._held.get(owner)
        if held is None or held.name != name:
            return False
        if held.expires <= sent:
            return False  # ran out here: ``_tidy`` deletes its node
        try:
            self.zk.set(held.path, with_ttl(held.holder, ttl))
        except NoNodeError:
            with self._mutex:
                self._held.pop(owner, None)
            return False
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        self._heard(sent, held.session)
        with self._mutex:
            held.expires = max(held.expires, sent + ttl)
        return True

    def do_extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]:
        """Every renewal sent at once, pipelined on the session, then each answer read."""
        sent = time.monotonic()
        try:
            client = self.client
        except BackendUnavailable as e:
            return [e] * len(leases)
        pending: list[tuple[Held | None, Any]] = []
        for name, owner, ttl in leases:
            with self._mutex:
                held = self._held.get(owner)
            if held is None or held.name != name or held.expires <= sent:
                pending.append((None, None))
                continue
            pending.append((held, client.set_async(held.path, with_ttl(held.holder, ttl))))
        results: list[bool | Exception] = []
        for (name, owner, ttl), (held, reply) in zip(leases, pending, strict=False):
            if held is None:
                results.append(False)  # not held here, or ran out here (``_tidy`` deletes it)
                continue
            try:
                reply.get(timeout=self.timeout)
            except NoNodeError:
                with self._mutex:
                    self._held.pop(owner, None)
                results.append(False)
            except ERRORS as e:
                results.append(self._unavailable(name, e))
            else:
                self._heard(sent, held.session)
                with self._mutex:
                    held.expires = max(held.expires, sent + ttl)
                results.append(True)
        return results

    def do_check(self, name: str, owner: str) -> bool:
        with self._mutex:
            held = self._held.get(owner)
        if held is None or held.name != name or held.expires <= time.monotonic():
            return False
        sent = time.monotonic()
        try:
            found = self.zk.synced_exists(held.path) is not None
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        if found:
            self._heard(sent, held.session)
        return found
