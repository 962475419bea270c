"""The ZooKeeper backend's session: settings, the kazoo client, what the process holds.

The lease is the session (the package docstring): :class:`ZooKeeperSession`
keeps the one kazoo client of a backend in a process, learns when the
service last answered (``session_end``), marks every lease lost when the
session expires, and keeps the process's nodes (deleting one whose lease ran
out here, and lock directories left empty).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.core import checks
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    NoNodeError,
    NotEmptyError,
)

from ..base import BackendUnavailable, BaseLockBackend
from .paths import (
    CONTENDER,
    ERRORS,
    GHOST_WATCH,
    NODE_MARK,
    SWEEP_AFTER,
    Bounded,
    escape,
    escape_cached,
    parse_location,
)

logger = logging.getLogger("django_dlock")


@dataclass(eq=False)
class Held:
    """A node of ours that holds (or held) a lock, as this process knows it."""

    name: str
    path: str
    token: int
    #: ``time.monotonic()`` at which its lease ends unless renewed (the process deletes it then).
    expires: float
    #: The session it lives in (its id); None once that session is gone.
    session: int | None
    holder: str


_backends: weakref.WeakSet[ZooKeeperSession] = weakref.WeakSet()


class ZooKeeperSession(BaseLockBackend):
    """Settings, the client and the session; the recipe is ``backend.py``."""

    supports_fair = True
    supports_wakeups = True
    supports_shared_leases = True
    #: A lease whose holder dies lasts until its session expires: the session
    #: timeout is the floor of what a TTL can mean (``OPTIONS["session_timeout"]``);
    #: the conformance suite's short leases use 2 s sessions.
    min_ttl = 2.0
    #: A killed holder's session ends up to a third of the session timeout
    #: (its last ping) plus two ticks after its last renewal.
    expiry_slack = 1.0
    allowed_options = frozenset({"chroot", "session_timeout", "timeout", "auth", "sweep"})

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        options = self.options
        self.session_timeout = self._number_option("session_timeout", 10.0)
        self.timeout = self._number_option("timeout", 5.0)
        self.sweep = options.get("sweep", True)
        if not isinstance(self.sweep, bool):
            raise self.config_error("OPTIONS['sweep'] must be True or False.")
        chroot = options.get("chroot")
        if chroot is not None and not isinstance(chroot, str):
            raise self.config_error("OPTIONS['chroot'] must be a str such as '/myapp'.")
        auth = options.get("auth", ())
        if not isinstance(auth, (list, tuple)) or not all(
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and all(isinstance(part, str) for part in pair)
            for pair in auth
        ):
            raise self.config_error(
                "OPTIONS['auth'] must be a list of (scheme, credential) pairs of str, "
                "such as [('digest', 'user:password')]."
            )
        self.auth = [tuple(pair) for pair in auth]
        try:
            self.hosts = parse_location(self.location, chroot)
        except ValueError as e:
            raise self.config_error(str(e)) from None
        self.root = "/" + escape(self.key_prefix + "dlock") if self.key_prefix else "/dlock"
        self._client: KazooClient | None = None
        self._client_mutex = threading.Lock()
        #: owner -> the node it holds
        self._held: dict[str, Held] = {}
        #: lock directories to delete once empty: path -> when
        self._sweep: dict[str, float] = {}
        self._sweeper: threading.Timer | None = None
        self._keeper: threading.Thread | None = None
        #: ``time.monotonic()`` since when kazoo has been disconnected (None: connected)
        self._suspended_since: float | None = None
        #: our nodes a failed call left behind: path -> lock name (``_tidy``)
        self._orphans: dict[str, str] = {}
        #: (directory, owner) of creates that went unanswered -> until when to look
        self._unsure: dict[tuple[str, str], float] = {}
        #: owners whose acquisition is under way (they delete their own ghosts)
        self._waiting: set[str] = set()
        #: When the latest answered request of the current session was sent
        #: (``time.monotonic()``), and that session's id.
        self._confirmed = 0.0
        self._confirmed_session: int | None = None
        self._mutex = threading.Lock()
        _backends.add(self)

    # --- settings -------------------------------------------------------------------------

    def check(self) -> list[checks.CheckMessage]:
        if self.default_ttl >= self.session_timeout:
            return []
        return [
            checks.Warning(
                f"Lock backend {self.alias!r}: TTL {self.default_ttl:g}s is shorter than "
                f"OPTIONS['session_timeout'] {self.session_timeout:g}s. A holder that dies "
                "keeps its locks until its ZooKeeper session expires, so they last the "
                "session timeout, not the TTL.",
                hint="Lower session_timeout to the TTL, or raise TTL.",
                id="django_dlock.W006",
            )
        ]

    # --- the client -----------------------------------------------------------------------

    @property
    def client(self) -> KazooClient:
        client = self._client
        if client is not None:
            since = self._suspended_since
            if since is None or time.monotonic() - since < self.negotiated() + self.timeout:
                return client
            # Cut off for longer than its session could outlive: that session is
            # gone, and a server that lost its data refuses it for good.
            self._drop_client(client, "the ZooKeeper session could not be reached")
        with self._client_mutex:
            if self._client is None:
                client = KazooClient(
                    hosts=self.hosts,
                    timeout=self.session_timeout,
                    auth_data=self.auth or None,
                    connection_retry={"max_tries": -1, "delay": 0.05, "max_delay": 1.0},
                    command_retry=None,
                )
                client.add_listener(self._on_state)
                try:
                    with warnings.catch_warnings():
                        # A chroot that does not exist yet: the first lock creates it.
                        warnings.filterwarnings("ignore", "No chroot path exists")
                        client.start(timeout=self.timeout)
                except ERRORS as e:
                    client.stop()
                    client.close()
                    raise self._unavailable("", e) from e
                self._client = client
            return self._client

    @property
    def zk(self) -> Bounded:
        """The client's blocking calls, each bounded by ``OPTIONS["timeout"]``."""
        return Bounded(self.client, self.timeout)

    def _session(self) -> int | None:
        client = self._client
        if client is None or client.client_id is None:
            return None
        return int(client.client_id[0])

    def negotiated(self) -> float:
        """The session timeout the server granted (seconds); the configured one until then."""
        client = self._client
        granted = getattr(client, "_session_timeout", 0) if client is not None else 0
        return granted / 1000 if granted else self.session_timeout

    def session_end(self, owner: str) -> float:
        # A node lives while its session does: until the session timeout after
        # the service last heard from it. A handle never counts on more, and on
        # nothing once its session is gone (its entry goes with it).
        held = self._held.get(owner)
        if held is None or held.session is None or held.session != self._confirmed_session:
            return -math.inf
        return self._confirmed + self.negotiated()

    def _heard(self, sent: float, session: int | None) -> None:
        """A request of ``session``'s sent at ``sent`` was answered: it lived then.

        Only the current session's answers count: a new session's say nothing
        of the nodes of the one that expired.
        """
        if session is None or session != self._session():
            return
        with self._mutex:
            if session != self._confirmed_session:
                self._confirmed_session, self._confirmed = session, sent
            elif sent > self._confirmed:
                self._confirmed = sent

    def _keepalive(self) -> None:
        """While this process has nodes here: confirm the session, and tidy up.

        Every fifth of the session timeout: a read request, whose answer
        tells us by our clock that the session still lived (``session_end``;
        kazoo's own pings keep it alive but say nothing of when); then the
        nodes a failed call left behind are deleted, and so are held nodes
        whose lease ran out here (a node lives as long as its session: left
        alone, a lock nobody renews would stay held while the process lives).
        """
        while True:
            with self._mutex:
                if self._client is None:
                    self._keeper = None
                    return
                client = self._client
                busy = bool(self._held or self._orphans or self._unsure)
            if not busy:
                # Idle: no request. The thread stays, so that a process taking a
                # lock after another does not start one each time.
                time.sleep(self.negotiated() / 5)
                continue
            sent, session = time.monotonic(), self._session()
            period = self.negotiated() / 5
            try:
                Bounded(client, min(self.timeout, period)).exists(self.root)
            except ERRORS:
                logger.debug("Confirming the ZooKeeper session failed", exc_info=True)
                if self._held and time.monotonic() > self._confirmed + self.negotiated():
                    # Unconfirmed for a whole session timeout: every handle counts
                    # its lease gone already; report it now, not at a renewal.
                    reason = "the ZooKeeper session could not be confirmed in time"
                    self._session_gone(reason, orphan=True)
            else:
                self._heard(sent, session)
                self._tidy(sent)
            time.sleep(period)

    def _tidy(self, now: float) -> None:
        """Delete the nodes left behind, and those whose lease ran out here."""
        with self._mutex:
            for owner, held in list(self._held.items()):
                if held.expires <= now:
                    del self._held[owner]
                    self._orphans[held.path] = held.name
            orphans = list(self._orphans.items())
            unsure = []
            for (directory, owner), until in list(self._unsure.items()):
                if until <= now:
                    del self._unsure[(directory, owner)]
                elif owner not in self._waiting:  # a waiting attempt sees its own
                    holding = self._held.get(owner)
                    keep = holding.path if holding is not None else None
                    unsure.append((directory, owner, keep))
        for path, name in orphans:
            with contextlib.suppress(BackendUnavailable):
                self._delete(name, path)
        for directory, owner, keep in unsure:
            self._delete_ghosts(directory, owner, keep)

    def _unsure_create(self, directory: str, owner: str) -> None:
        """A create of ``owner``'s went unanswered: it may land later, as a node nobody
        knows of (a "ghost", which would stand in the queue for as long as our
        session lives). ``_tidy`` looks for it for a while."""
        with self._mutex:
            self._unsure[(directory, owner)] = time.monotonic() + GHOST_WATCH
            self._keep()

    def _delete_ghosts(self, directory: str, owner: str, keep: str | None) -> None:
        """Delete ``owner``'s nodes in ``directory`` but ``keep`` (the one it holds)."""
        client = self._client
        if client is None:
            return
        mark = owner + NODE_MARK
        bounded = Bounded(client, self.timeout)
        try:
            children = bounded.synced_children(directory)
        except NoNodeError:
            return
        except ERRORS:
            logger.debug("Looking for ghosts in %r failed", directory, exc_info=True)
            return
        for child in children:
            path = f"{directory}/{child}"
            if child.startswith(mark) and path != keep:
                with contextlib.suppress(*ERRORS):
                    bounded.delete(path)

    def _orphan(self, name: str, path: str) -> None:
        """``path`` (or, ending in ``NODE_MARK``, our node with that prefix) must go."""
        with self._mutex:
            self._orphans[path] = name
            self._keep()

    def _keep(self) -> None:
        """Under the mutex: make sure the keepalive thread runs."""
        if self._keeper is None:
            self._keeper = threading.Thread(
                target=self._keepalive, daemon=True, name="django-dlock-zk-keepalive"
            )
            self._keeper.start()

    def _on_state(self, state: str) -> None:
        """kazoo's listener (its own thread: no calls to ZooKeeper here)."""
        if state == KazooState.CONNECTED:
            self._suspended_since = None
            return
        if self._suspended_since is None:
            self._suspended_since = time.monotonic()
        if state == KazooState.LOST:
            self._session_gone("the ZooKeeper session expired")

    def _session_gone(self, reason: str, orphan: bool = False) -> None:
        """Every lease of the session is lost: marked so at once, with ``lock_lost``.

        ``orphan``: the session may still live (it could not be confirmed in
        time), so its nodes are deleted once ZooKeeper answers (``_tidy``).
        """
        with self._mutex:
            self._confirmed_session, self._confirmed = None, 0.0
            lost = [h for h in self._held.values() if h.session is not None]
            for held in lost:
                held.session = None
                if orphan:
                    self._orphans[held.path] = held.name
        if lost:
            threading.Thread(
                target=self._mark_lost,
                args=(lost, reason),
                daemon=True,
                name="django-dlock-zk-lost",
            ).start()

    def _drop_client(self, client: KazooClient, reason: str) -> None:
        """Give up ``client`` and its session; the next call opens a new one.

        Its leases are lost (``_session_gone``); ending the session deletes
        their nodes, or the server does when the session times out.
        """
        with self._client_mutex:
            if self._client is not client:
                return
            self._client = None
            self._suspended_since = None
        self._session_gone(reason)
        threading.Thread(
            target=_stop, args=(client,), daemon=True, name="django-dlock-zk-close"
        ).start()

    def _mark_lost(self, lost: list[Held], reason: str) -> None:
        from ...watchdog import get_watchdog

        owners = {id(h) for h in lost}
        with self._mutex:
            gone = {o for o, h in self._held.items() if id(h) in owners}
            for owner in gone:
                del self._held[owner]
        for handle in get_watchdog().scheduled(self.alias):
            if getattr(handle, "owner", None) in gone and handle.backend is self:
                handle.lost_on_server(reason)

    def _unavailable(self, name: str, e: BaseException) -> BackendUnavailable:
        what = f"lock {name!r}" if name else "the service"
        return BackendUnavailable(
            f"ZooKeeper backend {self.alias!r} ({self.hosts}) failed for {what}: {e!r}",
            name=name or None,
            backend=self.alias,
        )

    def close(self) -> None:
        """End the session: every node of ours goes with it, held locks are released."""
        with self._client_mutex:
            client, self._client = self._client, None
        with self._mutex:
            self._held.clear()
            self._sweep.clear()
            if self._sweeper is not None:
                self._sweeper.cancel()
                self._sweeper = None
        if client is not None:
            try:
                client.stop()
                client.close()
            except Exception:  # pragma: no cover - the session ends with the process anyway
                logger.debug("Closing the ZooKeeper client failed", exc_info=True)

    # --- paths ----------------------------------------------------------------------------

    def _dir(self, name: str) -> str:
        return f"{self.root}/{escape_cached(name)}"

    @staticmethod
    def _contenders(children: Iterable[str]) -> list[tuple[str, str]]:
        """(sequence, child) of each contender, lowest sequence first."""
        found = []
        for child in children:
            m = CONTENDER.search(child)
            if m is not None:
                found.append((m.group(1), child))
        found.sort()
        return found

    # --- the nodes this process keeps ------------------------------------------------

    def _expire_at(self, owner: str, held: Held) -> None:
        """Delete ``held``'s node when its lease runs out here, unless extended by then."""
        from ...watchdog import get_watchdog

        def expire() -> None:
            with self._mutex:
                current = self._held.get(owner)
                if current is not held or held.expires > time.monotonic():
                    return
                del self._held[owner]
            self._delete(held.name, held.path)

        get_watchdog().call_at(held.expires, expire)

    def _delete(self, name: str, path: str, version: int = -1) -> bool:
        """Delete our node ``path``; if ZooKeeper does not answer, again later (``_tidy``).

        ``path`` ending in ``NODE_MARK`` is a node whose create went unanswered:
        whichever child has that prefix.
        """
        try:
            if path.endswith(NODE_MARK):
                directory, mark = path.rsplit("/", 1)
                found = [c for c in self.zk.get_children(directory) if c.startswith(mark)]
                for child in found:
                    self.zk.delete(f"{directory}/{child}")
                deleted = bool(found)
            else:
                self.zk.delete(path, version=version)
                deleted = True
        except NoNodeError:
            deleted = False
        except ERRORS as e:
            self._orphan(name, path)
            raise self._unavailable(name, e) from e
        with self._mutex:
            self._orphans.pop(path, None)
        if deleted:
            self._schedule_sweep(name)
        return deleted

    def _schedule_sweep(self, name: str) -> None:
        if not self.sweep:
            return
        with self._mutex:
            self._sweep[self._dir(name)] = time.monotonic() + SWEEP_AFTER
            if self._sweeper is None:
                self._sweeper = threading.Timer(SWEEP_AFTER, self._sweep_dirs)
                self._sweeper.name = "django-dlock-zk-sweep"
                self._sweeper.daemon = True
                self._sweeper.start()

    def _sweep_dirs(self) -> None:
        """Delete lock directories left empty (a new contender recreates its own)."""
        now = time.monotonic()
        with self._mutex:
            self._sweeper = None
            due = [d for d, at in self._sweep.items() if at <= now]
            for d in due:
                del self._sweep[d]
            busy = {self._dir(h.name) for h in self._held.values()}
            again = bool(self._sweep)
        client = self._client
        if client is not None:
            for directory in due:
                if directory in busy:
                    continue
                try:
                    Bounded(client, self.timeout).delete(directory)
                except (NotEmptyError, NoNodeError):
                    pass
                except ERRORS:
                    logger.debug("Deleting %r failed", directory, exc_info=True)
        if again:
            with self._mutex:
                if self._sweeper is None:
                    self._sweeper = threading.Timer(SWEEP_AFTER, self._sweep_dirs)
                    self._sweeper.daemon = True
                    self._sweeper.start()

    def _lookup(self, name: str, owner: str) -> str | None:
        """The path of ``owner``'s node of ``name``: ours, or found by its owner token."""
        with self._mutex:
            held = self._held.get(owner)
        if held is not None and held.name == name:
            return held.path
        directory = self._dir(name)
        try:
            children = self.zk.get_children(directory)
        except NoNodeError:
            return None
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        mark = owner + NODE_MARK
        for child in children:
            if child.startswith(mark):
                return f"{directory}/{child}"
        return None


def _stop(client: KazooClient) -> None:
    try:
        client.stop()
        client.close()
    except Exception:  # pragma: no cover - the session ends with the server's timeout anyway
        logger.debug("Closing a ZooKeeper client failed", exc_info=True)


def _reset_after_fork() -> None:
    # The parent's session belongs to the parent: a child that closed it would
    # end the parent's locks. Its client (and its threads) are not in the child.
    for backend in list(_backends):
        backend._client = None
        backend._client_mutex = threading.Lock()
        backend._mutex = threading.Lock()
        backend._held = {}
        backend._sweep = {}
        backend._sweeper = None
        backend._keeper = None
        backend._suspended_since = None
        backend._orphans = {}
        backend._unsure = {}
        backend._waiting = set()
        backend._confirmed = 0.0
        backend._confirmed_session = None


def _close_at_exit() -> None:
    from ...watchdog import get_watchdog

    watchdog = get_watchdog()
    for backend in list(_backends):
        for handle in watchdog.scheduled(backend.alias):
            if handle.backend is backend:
                watchdog.cancel(handle)
        backend.close()


os.register_at_fork(after_in_child=_reset_after_fork)
atexit.register(_close_at_exit)
