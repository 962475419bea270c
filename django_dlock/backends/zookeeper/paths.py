"""The ZooKeeper backend's names and calls: node paths, ``LOCATION``, bounded kazoo calls."""

from __future__ import annotations

import functools
import re
from typing import Any
from urllib.parse import quote, unquote

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError

#: What our nodes are called after the owner token: kazoo's ``Lock`` reads these.
NODE_MARK = "__lock__"
#: Contenders: kazoo's nodes (``__lock__``) and Curator's (``-lock-``), by sequence.
CONTENDER = re.compile(r"(?:__lock__|-lock-)(-?\d{10})$")
#: In the data of an adopted lease's node: the token it keeps.
TOKEN_KEY = "\x1fdlock:token"
#: A wait on the node ahead re-reads the children at least this often (seconds):
#: a safety net for a watch lost with a connection, not the way waiters are woken.
WAIT_CAP = 5.0
#: How long a create that went unanswered may still land (seconds): a request
#: queued on a connection that is down waits for it, and for the session, to come back.
GHOST_WATCH = 120.0
#: Empty lock directories are deleted this long after their last release (seconds).
SWEEP_AFTER = 2.0

ERRORS: tuple[type[BaseException], ...] = (KazooException, KazooTimeoutError)


def escape(name: str) -> str:
    """One path component for ``name``; a prefix of a name escapes to a prefix of its path."""
    return quote(name, safe="").replace(".", "%2E")


#: ``escape`` of the names in use (on every acquire and release).
escape_cached = functools.lru_cache(maxsize=4096)(escape)


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
    if "@" in text:
        # Not echoed: it would put the password in the message.
        raise ValueError(
            "LOCATION must not carry credentials (user:password@host): "
            "put them in OPTIONS['auth'], such as [('digest', 'user:password')]."
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


class Bounded:
    """kazoo's blocking calls, each given up after ``timeout`` seconds.

    kazoo's own wait with no limit: while it is disconnected (a server down,
    a partition, a server that lost its data and refuses the session) they
    would hang a ``with lock(...)`` block for good. A request given up on may
    still run later; the callers allow for that (ghosts, orphans).
    """

    __slots__ = ("client", "timeout")

    def __init__(self, client: KazooClient, timeout: float) -> None:
        self.client = client
        self.timeout = timeout

    def get_children(self, path: str) -> list[str]:
        result: list[str] = self.client.get_children_async(path).get(timeout=self.timeout)
        return result

    def get(self, path: str) -> tuple[bytes, Any]:
        data, stat = self.client.get_async(path).get(timeout=self.timeout)
        return data, stat

    def exists(self, path: str, watch: Any = None) -> Any:
        return self.client.exists_async(path, watch=watch).get(timeout=self.timeout)

    def set(self, path: str, value: bytes) -> Any:
        return self.client.set_async(path, value).get(timeout=self.timeout)

    def delete(self, path: str, version: int = -1) -> None:
        self.client.delete_async(path, version=version).get(timeout=self.timeout)

    def synced_children(self, path: str) -> list[str]:
        """The children as the leader has them: a sync, and the read pipelined behind it."""
        self.client.sync_async(path)
        return self.get_children(path)

    def synced_exists(self, path: str) -> Any:
        """``exists`` as the leader has it: a sync, and the read pipelined behind it."""
        self.client.sync_async(path)
        return self.exists(path)

    def ensure_path(self, path: str) -> None:
        self.client.ensure_path_async(path).get(timeout=self.timeout)

    def commit(self, transaction: Any) -> list[Any]:
        results: list[Any] = transaction.commit_async().get(timeout=self.timeout)
        return results
