"""ZooKeeperBackend: see the package docstring for the recipe and the node layout."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import re
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote, unquote

from django.core import checks
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)
from kazoo.handlers.threading import KazooTimeoutError

from ..base import Attempt, BackendUnavailable, BaseLockBackend, Grant, LockInfo, load_holder

logger = logging.getLogger("django_dlock")

#: What our nodes are called after the owner token: kazoo's ``Lock`` reads these.
NODE_MARK = "__lock__"
#: Contenders: kazoo's nodes (``__lock__``) and Curator's (``-lock-``), by sequence.
CONTENDER = re.compile(r"(?:__lock__|-lock-)(-?\d{10})$")
#: In the data of an adopted lease's node: the token it keeps.
TOKEN_KEY = "\x1fdlock:token"
#: A wait on the node ahead re-reads the children at least this often (seconds):
#: a safety net for a watch lost with a connection, not the way waiters are woken.
WAIT_CAP = 5.0
#: Empty lock directories are deleted this long after their last release (seconds).
SWEEP_AFTER = 2.0

ERRORS: tuple[type[BaseException], ...] = (KazooException, KazooTimeoutError)

_backends: weakref.WeakSet[ZooKeeperBackend] = weakref.WeakSet()


def escape(name: str) -> str:
    """One path component for ``name``; a prefix of a name escapes to a prefix of its path."""
    return quote(name, safe="").replace(".", "%2E")


def unescape(component: str) -> str:
    return unquote(component)


def parse_location(location: Any, chroot: str | None) -> str:
    """kazoo's ``hosts`` string (``h1:p1,h2:p2/chroot``) from ``LOCATION`` and ``chroot``."""
    if isinstance(location, (list, tuple)):
        if not location or not all(isinstance(h, str) and h for h in location):
            raise ValueError("LOCATION must be a non-empty list of 'host:port' strings.")
        text = ",".join(location)
    elif isinstance(location, str) and location:
        text = location
    else:
        raise ValueError(
            "LOCATION must be 'host:port', a list of them, or a 'zk://host:port,.../chroot' URL."
        )
    path = ""
    if text.startswith("zk://"):
        text = text[len("zk://") :]
        if "/" in text:
            text, path = text.split("/", 1)
            path = "/" + path.rstrip("/") if path.strip("/") else ""
    elif "://" in text:
        raise ValueError(f"LOCATION {location!r}: the only URL scheme is zk://.")
    elif "/" in text:
        text, path = text.split("/", 1)
        path = "/" + path.rstrip("/") if path.strip("/") else ""
    hosts = [h.strip() for h in text.split(",")]
    for host in hosts:
        h, sep, port = host.rpartition(":")
        if not host or (sep and (not h or not port.isdigit() or not 0 < int(port) < 65536)):
            raise ValueError(f"LOCATION {location!r}: {host!r} is not 'host:port'.")
    if chroot is not None:
        if path:
            raise ValueError(
                "the chroot is given twice: in LOCATION's path and OPTIONS['chroot']."
            )
        path = chroot.rstrip("/")
    if path and (not path.startswith("/") or "//" in path or "\x00" in path):
        raise ValueError(f"the chroot {path!r} must be an absolute path such as '/myapp'.")
    return ",".join(hosts) + path


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


class ZooKeeperBackend(BaseLockBackend):
    """Locks in ZooKeeper; see the package docstring for the recipe and the layout."""

    attempt_class = ZooKeeperAttempt
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
    allowed_options = frozenset({"chroot", "session_timeout", "timeout", "auth"})

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        options = self.options
        self.session_timeout = self._number_option("session_timeout", 10.0)
        self.timeout = self._number_option("timeout", 5.0)
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
        #: ``time.monotonic()`` when the latest request the service answered was sent.
        self._confirmed = 0.0
        self._mutex = threading.Lock()
        _backends.add(self)

    # --- settings -------------------------------------------------------------------------

    def check(self) -> list[checks.CheckMessage]:
        messages: list[checks.CheckMessage] = []
        if self.session_timeout < 2:
            messages.append(
                checks.Warning(
                    f"Lock backend {self.alias!r}: a session timeout of "
                    f"{self.session_timeout:g}s is shorter than ZooKeeper grants by "
                    "default (2 ticks: 4 s); the server raises it.",
                    id="django_dlock.W020",
                )
            )
        if self.default_ttl < self.session_timeout:
            messages.append(
                checks.Info(
                    f"Lock backend {self.alias!r}: TTL {self.default_ttl:g}s is shorter than "
                    f"the session timeout {self.session_timeout:g}s: a holder that dies keeps "
                    "its locks until its session expires.",
                    id="django_dlock.I021",
                )
            )
        return messages

    # --- the client -----------------------------------------------------------------------

    @property
    def client(self) -> KazooClient:
        client = self._client
        if client is not None:
            return client
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

    def session_end(self) -> float:
        # Our nodes live while the session does: until the session timeout after
        # the service last heard from us. A handle never counts on more.
        return self._confirmed + self.negotiated()

    def _heard(self, sent: float) -> None:
        """A request sent at ``sent`` was answered: the session lived then."""
        if sent > self._confirmed:
            self._confirmed = sent

    def _keepalive(self) -> None:
        """While this process holds locks here, confirm the session every fifth of its timeout.

        kazoo's pings keep the session alive; these read requests tell us, by
        our clock, that it still was (``session_end``).
        """
        while True:
            with self._mutex:
                if not self._held or self._client is None:
                    self._keeper = None
                    return
                client = self._client
            sent = time.monotonic()
            try:
                client.exists(self.root)
            except ERRORS:
                logger.debug("Confirming the ZooKeeper session failed", exc_info=True)
            else:
                self._heard(sent)
            time.sleep(self.negotiated() / 5)

    def _keep(self) -> None:
        """Under the mutex: make sure the keepalive thread runs."""
        if self._keeper is None:
            self._keeper = threading.Thread(
                target=self._keepalive, daemon=True, name="django-dlock-zk-keepalive"
            )
            self._keeper.start()

    def _on_state(self, state: str) -> None:
        """kazoo's listener (its own thread: no calls to ZooKeeper here)."""
        if state == KazooState.LOST:
            self._confirmed = 0.0
            with self._mutex:
                lost = [h for h in self._held.values() if h.session is not None]
                for held in lost:
                    held.session = None
            if lost:
                threading.Thread(
                    target=self._mark_lost, args=(lost,), daemon=True, name="django-dlock-zk-lost"
                ).start()

    def _mark_lost(self, lost: list[Held]) -> None:
        from ...watchdog import get_watchdog

        owners = {id(h) for h in lost}
        with self._mutex:
            gone = {o for o, h in self._held.items() if id(h) in owners}
            for owner in gone:
                del self._held[owner]
        for handle in get_watchdog().scheduled(self.alias):
            if getattr(handle, "owner", None) in gone and handle.backend is self:
                handle.lost_on_server("the ZooKeeper session expired")

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
        return f"{self.root}/{escape(name)}"

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
        name, _owner = attempt.name, attempt.owner
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
                children = client.get_children(directory)
        except NoNodeError:
            children = []
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        mine = attempt.node.rsplit("/", 1)[1] if attempt.node else None
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
            session = self._session()
            sent = time.monotonic()
            created = client.create_async(
                prefix, data, ephemeral=True, sequence=True, include_data=True
            )
            listed = client.get_children_async(directory)
            try:
                path, stat = created.get(timeout=self.timeout)
            except NoNodeError:
                with contextlib.suppress(NoNodeError):
                    listed.get(timeout=self.timeout)
                with contextlib.suppress(NodeExistsError):
                    client.ensure_path(directory)
                continue
            self._heard(sent)
            attempt.node, attempt.czxid, attempt.session = path, int(stat.czxid), session
            children: list[str] = listed.get(timeout=self.timeout)
            return children
        raise NoNodeError(directory)

    def _find_node(self, attempt: ZooKeeperAttempt, directory: str) -> None:
        try:
            children = self.client.get_children(directory)
        except NoNodeError:
            return
        mark = attempt.owner + NODE_MARK
        for child in children:
            if child.startswith(mark):
                path = f"{directory}/{child}"
                stat = self.client.exists(path)
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
            self._held[attempt.owner] = held
            self._sweep.pop(self._dir(attempt.name), None)
            self._keep()
        if not attempt.renew:
            self._expire_at(attempt.owner, held)
        attempt.node = None
        return attempt.czxid

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

    def _wait_ahead(self, attempt: ZooKeeperAttempt, remaining: float | None) -> None:
        """Until the node ahead of ours goes (its watch), or ``remaining`` runs out."""
        ahead = attempt.ahead
        if ahead is None or attempt.stopped:
            return
        event = attempt.waking = threading.Event()
        try:
            if self.client.exists(ahead, watch=lambda _event: event.set()) is None:
                return
        except ERRORS as e:
            raise self._unavailable(attempt.name, e) from e
        cap = WAIT_CAP if remaining is None else min(remaining, WAIT_CAP)
        event.wait(max(0.0, cap))

    def _leave_queue(self, attempt: ZooKeeperAttempt) -> None:
        node, attempt.node, attempt.ahead = attempt.node, None, None
        if node is None and attempt.create_sent:
            try:
                self._find_node(attempt, self._dir(attempt.name))
            except ERRORS:
                logger.debug("Looking for %r's node failed", attempt.name, exc_info=True)
            node, attempt.node = attempt.node, None
        if node is not None:
            self._delete(attempt.name, node)

    def _delete(self, name: str, path: str, version: int = -1) -> bool:
        try:
            self.client.delete(path, version=version)
        except NoNodeError:
            return False
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        self._schedule_sweep(name)
        return True

    def _schedule_sweep(self, name: str) -> None:
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
                    client.delete(directory)
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

    # --- release, extend, check -----------------------------------------------------------

    def _lookup(self, name: str, owner: str) -> str | None:
        """The path of ``owner``'s node of ``name``: ours, or found by its owner token."""
        with self._mutex:
            held = self._held.get(owner)
        if held is not None and held.name == name:
            return held.path
        directory = self._dir(name)
        try:
            children = self.client.get_children(directory)
        except NoNodeError:
            return None
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        mark = owner + NODE_MARK
        for child in children:
            if child.startswith(mark):
                return f"{directory}/{child}"
        return None

    def do_release(self, name: str, owner: str) -> bool:
        with self._mutex:
            held = self._held.pop(owner, None)
        if held is not None and held.expires <= time.monotonic():
            # Ran out here before the release: the lease had ended (the node goes now).
            self._delete(name, held.path)
            return False
        path = held.path if held is not None else self._lookup(name, owner)
        if path is None:
            return False
        return self._delete(name, path)

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        return self._extend(name, owner, ttl, time.monotonic())

    def _extend(self, name: str, owner: str, ttl: float, sent: float) -> bool:
        with self._mutex:
            held = self._held.get(owner)
        if held is None or held.name != name:
            return False
        if held.expires <= sent:
            self.do_release(name, owner)
            return False
        try:
            self.client.set(held.path, _with_ttl(held.holder, ttl))
        except NoNodeError:
            with self._mutex:
                self._held.pop(owner, None)
            return False
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        self._heard(sent)
        with self._mutex:
            held.expires = max(held.expires, sent + ttl)
        return True

    def do_extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]:
        """Every renewal sent at once, pipelined on the session, then each answer read."""
        sent = time.monotonic()
        client = self.client
        pending: list[tuple[Held | None, Any]] = []
        for name, owner, ttl in leases:
            with self._mutex:
                held = self._held.get(owner)
            if held is None or held.name != name or held.expires <= sent:
                pending.append((None, None))
                continue
            pending.append((held, client.set_async(held.path, _with_ttl(held.holder, ttl))))
        results: list[bool | Exception] = []
        for (name, owner, ttl), (held, reply) in zip(leases, pending, strict=False):
            if held is None:
                results.append(self.do_release(name, owner) and False)
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
                self._heard(sent)
                with self._mutex:
                    held.expires = max(held.expires, sent + ttl)
                results.append(True)
        return results

    def do_check(self, name: str, owner: str) -> bool:
        with self._mutex:
            held = self._held.get(owner)
        if held is None or held.name != name or held.expires <= time.monotonic():
            return False
        try:
            self.client.sync(held.path)
            return self.client.exists(held.path) is not None
        except ERRORS as e:
            raise self._unavailable(name, e) from e

    # --- tickets --------------------------------------------------------------------------

    def do_detach(self, name: str, owner: str) -> Any:
        with self._mutex:
            held = self._held.get(owner)
        if held is None:
            return None
        if held.expires > time.monotonic():
            # The node outlives the handle until its lease runs out here, or
            # until this process ends (its session ends with it).
            self._expire_at(owner, held)
        return {"path": held.path, "token": held.token}

    def do_adopt(self, name: str, owner: str, new_owner: str, ttl: float, state: Any) -> bool:
        """Swap ``owner``'s node for ours in one transaction, at the same place in the queue."""
        client = self.client
        path = state.get("path") if isinstance(state, Mapping) else None
        if not isinstance(path, str):
            path = self._lookup(name, owner)
            if path is None:
                return False
        directory, child = path.rsplit("/", 1)
        if not child.startswith(owner + NODE_MARK):
            return False
        try:
            data, stat = client.get(path)
        except NoNodeError:
            return False
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        text = data.decode(errors="replace")
        holder = load_holder(text)
        token = holder.get(TOKEN_KEY, int(stat.czxid))
        holder[TOKEN_KEY] = token
        sequence = child[len(owner + NODE_MARK) :]
        new_path = f"{directory}/{new_owner}{NODE_MARK}{sequence}"
        sent = time.monotonic()
        transaction = client.transaction()
        transaction.delete(path, version=stat.version)
        transaction.create(new_path, json.dumps(holder).encode(), ephemeral=True)
        try:
            results = transaction.commit()
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        if any(isinstance(r, Exception) for r in results):
            return False
        held = Held(name, new_path, int(token), sent + ttl, self._session(), json.dumps(holder))
        self._heard(sent)
        with self._mutex:
            self._held[new_owner] = held
            self._keep()
            mine = self._held.get(owner)
            if mine is not None and mine.path == path:
                del self._held[owner]
        return True

    # --- operations -----------------------------------------------------------------------

    def do_break(self, name: str, token: int | None) -> bool:
        directory = self._dir(name)
        client = self.client
        try:
            for _ in range(10):
                try:
                    children = client.get_children(directory)
                except NoNodeError:
                    return False
                contenders = self._contenders(children)
                if not contenders:
                    return False
                path = f"{directory}/{contenders[0][1]}"
                try:
                    data, stat = client.get(path)
                except NoNodeError:
                    continue  # released meanwhile: look again
                if token is not None and _token(data, stat) != token:
                    return False
                try:
                    client.delete(path, version=stat.version)
                except (NoNodeError, BadVersionError):
                    if token is not None:
                        return False
                    continue
                self._schedule_sweep(name)
                return True
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        return False

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        client = self.client
        try:
            client.sync("/")
            client.exists(self.root)
        except ERRORS as e:
            raise self._unavailable("", e) from e
        version = "ZooKeeper"
        try:
            reply = client.command(b"srvr")
            first = reply.splitlines()[0] if reply else ""
            if first.startswith("Zookeeper version:"):
                version = "ZooKeeper " + first.split(":", 1)[1].strip().split("-", 1)[0]
        except Exception:  # srvr not in 4lw.commands.whitelist: the version is unknown
            logger.debug("ZooKeeper's srvr command failed", exc_info=True)
        return version, ()

    def do_list(self, prefix: str) -> list[LockInfo]:
        client = self.client
        start = escape(prefix)
        try:
            try:
                names = [n for n in client.get_children(self.root) if n.startswith(start)]
            except NoNodeError:
                return []
            listings = [(n, client.get_children_async(f"{self.root}/{n}")) for n in names]
            heads = []
            for n, listing in listings:
                try:
                    contenders = self._contenders(listing.get(timeout=self.timeout))
                except NoNodeError:
                    continue
                if contenders:
                    path = f"{self.root}/{n}/{contenders[0][1]}"
                    heads.append((n, client.get_async(path)))
            infos = []
            now = datetime.now(timezone.utc)
            for n, reply in heads:
                try:
                    data, stat = reply.get(timeout=self.timeout)
                except NoNodeError:
                    continue
                infos.append(self._info(unescape(n), data, stat, now))
            return infos
        except ERRORS as e:
            raise self._unavailable(prefix, e) from e

    def do_get(self, name: str) -> LockInfo | None:
        directory = self._dir(name)
        client = self.client
        try:
            for _ in range(10):
                try:
                    contenders = self._contenders(client.get_children(directory))
                except NoNodeError:
                    return None
                if not contenders:
                    return None
                try:
                    data, stat = client.get(f"{directory}/{contenders[0][1]}")
                except NoNodeError:
                    continue
                return self._info(name, data, stat, datetime.now(timezone.utc))
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        return None

    def _info(self, name: str, data: bytes, stat: Any, now: datetime) -> LockInfo:
        text = data.decode(errors="replace")
        holder = load_holder(text)
        token = holder.pop(TOKEN_KEY, None)
        ttl = holder.get("ttl")
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not math.isfinite(ttl):
            ttl = self.negotiated()
        # The node's last write (acquire, renewal, extend) by the leader's clock, plus its TTL.
        written = datetime.fromtimestamp(stat.mtime / 1000, timezone.utc)
        expires_at = written + timedelta(seconds=max(float(ttl), 0.0))
        acquired = datetime.fromtimestamp(stat.ctime / 1000, timezone.utc)
        return LockInfo(
            backend=self.alias,
            name=name,
            token=int(token) if isinstance(token, int) else int(stat.czxid),
            holder=holder,
            acquired_at=acquired,
            expires_at=expires_at,
            expires_in=max(0.0, (expires_at - now).total_seconds()),
            holder_json=None if token is not None else text,
        )


def _with_ttl(holder: str, ttl: float) -> bytes:
    """The node's data with its TTL set to ``ttl`` (what listing counts from the write)."""
    data = load_holder(holder)
    data["ttl"] = ttl
    return json.dumps(data).encode()


def _token(data: bytes, stat: Any) -> int:
    holder = load_holder(data.decode(errors="replace"))
    token = holder.get(TOKEN_KEY)
    return int(token) if isinstance(token, int) else int(stat.czxid)


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
        backend._confirmed = 0.0


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
