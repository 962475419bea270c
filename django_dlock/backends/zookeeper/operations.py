"""The ZooKeeper backend's tickets and operations: detach and adopt, break, ping, list."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from kazoo.exceptions import (
    BadVersionError,
    NoNodeError,
)

from ..base import LockInfo, load_holder
from .paths import ERRORS, NODE_MARK, TOKEN_KEY, escape, unescape
from .session import Held, ZooKeeperSession

logger = logging.getLogger("django_dlock")


class ZooKeeperOperations(ZooKeeperSession):
    """Tickets, break, ping, list and get, on the session's client."""

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
            data, stat = self.zk.get(path)
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
        session = self._session()
        try:
            results = self.zk.commit(transaction)
        except ERRORS as e:
            raise self._unavailable(name, e) from e
        if any(isinstance(r, Exception) for r in results):
            return False
        held = Held(name, new_path, int(token), sent + ttl, session, json.dumps(holder))
        self._heard(sent, session)
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
        try:
            for _ in range(10):
                try:
                    children = self.zk.get_children(directory)
                except NoNodeError:
                    return False
                contenders = self._contenders(children)
                if not contenders:
                    return False
                path = f"{directory}/{contenders[0][1]}"
                try:
                    data, stat = self.zk.get(path)
                except NoNodeError:
                    continue  # released meanwhile: look again
                if token is not None and _token(data, stat) != token:
                    return False
                try:
                    self.zk.delete(path, version=stat.version)
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
            self.zk.synced_exists(self.root)
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
                names = [n for n in self.zk.get_children(self.root) if n.startswith(start)]
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
        try:
            for _ in range(10):
                try:
                    contenders = self._contenders(self.zk.get_children(directory))
                except NoNodeError:
                    return None
                if not contenders:
                    return None
                try:
                    data, stat = self.zk.get(f"{directory}/{contenders[0][1]}")
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


def with_ttl(holder: str, ttl: float) -> bytes:
    """The node's data with its TTL set to ``ttl`` (what listing counts from the write)."""
    data = load_holder(holder)
    data["ttl"] = ttl
    return json.dumps(data).encode()


def _token(data: bytes, stat: Any) -> int:
    holder = load_holder(data.decode(errors="replace"))
    token = holder.get(TOKEN_KEY)
    return int(token) if isinstance(token, int) else int(stat.czxid)
