"""The etcd backend's lock algorithm and settings (see the package docstring).

The modules beside this one: ``transport`` (gRPC channels, calls, failover,
errors), ``watches`` (one Watch stream per process) and ``sessions`` (session
leases, their keep-alive, and this process's acquisitions).
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import grpc
from django.core import checks

from ..._validation import load_holder
from ...exceptions import BackendUnavailable
from ..base import Attempt, BaseLockBackend, Grant, LockInfo
from ..ops import MutexOps
from . import etcdrpc as rpc
from .epochs import Epochs
from .handover import EtcdHandover
from .renewals import EtcdRenewals
from .sessions import Entry, Sessions, lease_seconds
from .slots import EtcdSlots
from .transport import (
    CREATE_ASC,
    CREATE_DESC,
    Endpoint,
    LeaseNotFound,
    Transport,
    created_at,
    delete,
    encode_op,
    escape,
    get,
    parse_location,
    put,
    queue_txn,
    range_end,
    txn,
    unescape,
)

_backends: weakref.WeakSet[EtcdBackend] = weakref.WeakSet()


#: In a forked child: the parent's sessions and channels, kept and never used.
#: Dropped, their gRPC objects would be freed in the child, and freeing them
#: runs gRPC code on locks that the parent's gRPC threads (which the child
#: does not have) may have held at the fork.
_inherited: list[Any] = []


def _reset_after_fork() -> None:
    # The parent's sessions, channels and acquisitions are the parent's.
    for backend in list(_backends):
        if backend._state is not None:
            _inherited.append(backend._state)
        backend._state = None


def _close_at_exit() -> None:
    from ...watchdog import get_watchdog  # the watchdog sits above the backends

    watchdog = get_watchdog()
    for backend in list(_backends):
        # The leases are revoked here, as the process ends: a renewal that
        # came after would find them gone and report each lost (lock_lost).
        for held in watchdog.scheduled(backend.alias):
            if held.backend is backend:
                watchdog.cancel(held)
        backend.close()


os.register_at_fork(after_in_child=_reset_after_fork)
atexit.register(_close_at_exit)


class EtcdAttempt(Attempt):
    """An acquisition queued as a key under the lock's prefix.

    It keeps its queue entry (the key and its lease) and the key just ahead of
    it, which waiting watches for its delete; giving up deletes its key. The
    backend also records the entry under the owner (``state.entries``): once
    granted, release, extend and detach find the key there.
    """

    backend: EtcdBackend
    #: Our key in the queue, once put (None: not queued, or it is gone).
    entry: Entry | None = None
    #: The key just ahead of ours and the revision at which we saw it.
    ahead: tuple[bytes, int] | None = None

    def try_acquire(self) -> int | Grant | None:
        return self.backend._try_acquire(self)

    def wait(self, remaining: float | None) -> None:
        self.backend._watch_ahead(self, remaining)

    def abandon(self) -> None:
        self.entry = self.ahead = None
        self.backend._leave_queue(self.name, self.owner)


class EtcdBackend(EtcdHandover, EtcdRenewals, EtcdSlots, BaseLockBackend):
    """Locks in etcd v3; see the package docstring for the algorithm and key layout."""

    attempt_class = EtcdAttempt

    supports_fair = True
    supports_shared_leases = True
    supports_wakeups = True
    #: etcd leases are whole seconds, and etcd grants none shorter than about
    #: 1.5 election timeouts: a TTL is rounded up to a whole second.
    min_ttl = 1.0
    expiry_slack = 0.5
    allowed_options = frozenset({"ca", "cert", "key", "user", "password", "timeout"})

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        options = self.options
        self.timeout = self._number_option("timeout", 5.0)
        for key in ("ca", "cert", "key", "user", "password"):
            if options.get(key) is not None and not isinstance(options[key], (str, os.PathLike)):
                raise self.config_error(f"OPTIONS[{key!r}] must be a str.")
        if ("cert" in options) != ("key" in options):
            raise self.config_error("OPTIONS 'cert' and 'key' go together (a client certificate).")
        if ("user" in options) != ("password" in options):
            raise self.config_error("OPTIONS 'user' and 'password' go together.")
        try:
            self.endpoints, self.secure = parse_location(self.location, options)
        except ValueError as e:
            raise self.config_error(str(e)) from None
        self.root = f"{self.key_prefix}dlock/".encode()
        self._state: Sessions | None = None
        self._state_mutex = threading.Lock()
        # Building the keys and the range op shows in the uncontended cycle.
        self._names = functools.lru_cache(maxsize=4096)(self._make_names)
        _backends.add(self)

    def check(self) -> list[checks.CheckMessage]:
        messages: list[checks.CheckMessage] = []
        for key in ("ca", "cert", "key"):
            path = self.options.get(key)
            if path is not None and not os.path.isfile(path):
                messages.append(
                    checks.Error(
                        f"Lock backend {self.alias!r}: OPTIONS[{key!r}] {str(path)!r} is not "
                        "a readable file.",
                        id="django_dlock.E006",
                    )
                )
        return messages

    # --- per-process state ------------------------------------------------------------

    def _credentials(self) -> Any:
        if not self.secure:
            return None

        def read(key: str) -> bytes | None:
            path = self.options.get(key)
            if path is None:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise self.config_error(f"cannot read OPTIONS[{key!r}]: {e}") from e

        return grpc.ssl_channel_credentials(
            root_certificates=read("ca"), private_key=read("key"), certificate_chain=read("cert")
        )

    @property
    def state(self) -> Sessions:
        """This process's sessions on this backend, connected on first use."""
        state = self._state
        if state is None:
            with self._state_mutex:
                if self._state is None:
                    credentials = self._credentials()
                    transport = Transport(
                        self.alias,
                        [Endpoint(target, credentials) for target in self.endpoints],
                        self.timeout,
                        self.options.get("user"),
                        self.options.get("password"),
                    )
                    self._state = Sessions(transport, Epochs(self.key_prefix, transport))
                state = self._state
        return state

    @property
    def holds_leases(self) -> bool:
        """Whether locks taken through this backend object are held (``handler.reset``)."""
        state = self._state
        return state is not None and bool(state.entries)

    def close(self) -> None:
        """Revoke this process's leases (held locks are released at once) and disconnect."""
        with self._state_mutex:
            state, self._state = self._state, None
        if state is not None:
            state.close()

    def _call(self, name: str, stub: str, method: str, request: Any, **kwargs: Any) -> Any:
        return self.state.call(name, stub, method, request, **kwargs)

    def _txn(self, name: str, request: Any, **kwargs: Any) -> Any:
        return self._call(name, "kv", "Txn", request, **kwargs)

    # --- primitives -------------------------------------------------------------------

    def _base(self, name: str) -> bytes:
        return self.root + escape(name) + b"/"

    def _make_names(self, name: str) -> tuple[bytes, bytes, bytes]:
        """``Pdlock/N/``, the end of its range, and the op that reads its two newest keys.

        The op is encoded for :func:`~.transport.queue_txn`.
        """
        base = self._base(name)
        end = range_end(base)
        return base, end, encode_op(get(base, end, limit=2, keys_only=True, **CREATE_DESC))

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        """One attempt on its own, going on from ``owner``'s queued key if it has one."""
        attempt = EtcdAttempt(MutexOps(self), name, owner, ttl, ({}, holder), renew)
        attempt.entry = self.state.entries.get(owner)
        return self._try_acquire(attempt)

    def _try_acquire(self, attempt: EtcdAttempt) -> int | Grant | None:
        name, owner, ttl, holder, renew = (
            attempt.name, attempt.owner, attempt.ttl, attempt.holder[1], attempt.renew,
        )  # fmt: skip
        state = self.state
        started = time.monotonic()
        if attempt.entry is not None:
            return self._recheck(attempt)
        base, _, newest_two = self._names(name)
        state.epochs.look(name)
        lease = state.take_slot(name, base, ttl, renew)
        key = base + f"{lease.id:x}".encode()
        entry = attempt.entry = Entry(base, key, lease, lease)
        with state.mutex:
            state.entries[owner] = entry
        # Put our key if it does not exist, and read the two newest keys:
        # within this transaction ours is the newest key under base, the one
        # before it is the key to watch, and if there is none, ours is the
        # lowest and we hold the lock. Failing, read our key.
        request = queue_txn(key, lease.id, holder.encode(), newest_two + state.epochs.encoded)
        try:
            for _ in range(3):
                retried: list[bool] = []
                reply = self._call(name, "raw_kv", "Txn", request, ambiguous=retried)
                if reply.succeeded:
                    break
                [kv] = reply.responses[0].response_range.kvs or [None]
                if kv is not None and retried and kv.lease == lease.id:
                    # Our put was applied by the try that failed over: the key is ours.
                    entry.revision = kv.create_revision
                    return self._recheck(attempt)
                if kv is not None:
                    # Left by a release of ours that could not reach etcd: never
                    # reuse its revision as a token; delete it and put anew.
                    self._txn(name, txn([created_at(key, kv.create_revision)], [delete(key)]))
            else:
                raise BackendUnavailable(
                    f"etcd key {key!r} for lock {name!r} on backend {self.alias!r} keeps "
                    "coming back.",
                    name=name,
                    backend=self.alias,
                )
        except LeaseNotFound:
            # Revoked behind our back, or etcd lost its data: use a new lease.
            lease.expires = 0.0
            attempt.entry = None
            self.state.forget(owner)
            self.state.drop_session(lease)
            return self._try_acquire(attempt)
        except BaseException:
            attempt.entry = None
            self.state.forget(owner)
            if not lease.private:
                # The put may have been applied (a timeout, a cancelled call):
                # the session lease would keep that key alive for good.
                self.state.delete_unknown(key, lease)
            raise
        # Our key was created by this transaction: its create revision is the
        # reply's (the delete below compares it; 0 would leave the key).
        entry.revision = reply.header.revision
        if state.epochs.suspect:
            # etcd went back to an older revision (a restore), or this is the
            # process's first look: our key took the old epoch. Put it anew
            # after a look (a new epoch).
            self._leave_queue(name, owner)
            if lease.private:
                state.revoke_quietly(lease)
            attempt.entry = attempt.ahead = None
            return self._try_acquire(attempt)
        entry.epoch = state.epochs.epoch_for(
            state.epochs.parse(reply.responses[2].response_range.kvs), entry.revision
        )
        newest = reply.responses[1].response_range.kvs
        if len(newest) < 2:  # only ours
            return self._granted(name, entry, ttl, started)
        ahead = [kv for kv in newest if kv.key != key]
        attempt.ahead = (ahead[0].key, entry.revision)
        return None

    def _recheck(self, attempt: EtcdAttempt) -> int | Grant | None:
        """After a wait: are we first now? If not, whom to watch next."""
        name, entry = attempt.name, attempt.entry
        assert entry is not None
        _, end, _ = self._names(name)
        reply = self._txn(
            name,
            txn(
                [created_at(entry.key, entry.revision)],
                [
                    # The newest key older than ours; none: ours is the lowest.
                    get(
                        entry.base,
                        end,
                        limit=1,
                        keys_only=True,
                        max_create_revision=entry.revision - 1,
                        **CREATE_DESC,
                    ),
                ],
            ),
        )
        if not reply.succeeded:
            # Our key is gone (its lease ran out, or someone broke the queue
            # entry): queue again at the back.
            attempt.entry = attempt.ahead = None
            self.state.forget(attempt.owner)
            return None
        ahead = reply.responses[0].response_range.kvs
        if not ahead:
            return self._granted(name, entry, attempt.ttl, None)
        attempt.ahead = (ahead[0].key, reply.header.revision)
        return None

    def _granted(self, name: str, entry: Entry, ttl: float, started: float | None) -> int | Grant:
        lease = entry.lease
        if entry.epoch is None:
            # No epoch was read with the key (the data went after our look, or
            # the put was applied by a try that failed over): look now.
            entry.epoch = self.state.epochs.token_of(name, entry.revision) - entry.revision
        token = entry.epoch + entry.revision
        now = time.monotonic()
        if lease.expires - now < ttl / 2 and not self.state.keepalive(name, lease):
            # Cannot happen while the key exists; treat as a lease that ends now.
            return Grant(token, now, 0.001)
        if started is not None and lease.expires - lease.ttl >= started and lease.ttl >= ttl:
            # Granted or refreshed within this attempt: it runs at least ``ttl``
            # from when the caller sent the attempt.
            return token
        return Grant(token, lease.expires, max(lease.expires - now, 0.001))

    def _watch_ahead(self, attempt: EtcdAttempt, remaining: float | None) -> None:
        """Watch the key ahead of ours for its delete; keep our lease alive meanwhile."""
        entry, ahead = attempt.entry, attempt.ahead
        if entry is None or ahead is None:
            return
        lease = entry.lease
        refresh_in = lease.expires - time.monotonic() - lease.ttl / 2
        timeout = refresh_in if remaining is None else min(remaining, refresh_in)
        if timeout > 0:
            watches = self.state.watches
            wake = watches.watch(ahead[0], ahead[1] + 1)
            attempt.waking = wake.event  # stop() sets it
            try:
                if not attempt.stopped:
                    wake.event.wait(timeout)
            finally:
                attempt.waking = None
                watches.cancel(wake)
        if lease.expires - time.monotonic() <= lease.ttl / 2:
            self.state.keepalive(attempt.name, lease)

    def do_release(self, name: str, owner: str) -> bool:
        entry = self.state.forget(owner, revoke=False)
        if entry is None:
            return False
        retried: list[bool] = []
        reply = self.state.delete_entry(name, entry, ambiguous=retried)
        # A delete that failed over may have been applied by the first try.
        return bool(reply.succeeded) or bool(retried)

    def _leave_queue(self, name: str, owner: str) -> None:
        entry = self.state.forget(owner, revoke=False)
        if entry is not None:
            self.state.delete_entry(name, entry)

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        entry = self.state.entries.get(owner)
        if entry is None:
            return False
        seconds = lease_seconds(ttl)
        if seconds != entry.lease.seconds:  # not entry.lease.ttl: etcd may have raised it
            return self._move(name, owner, entry, seconds)
        if not self.state.keepalive(name, entry.lease):
            self.state.forget(owner)
            return False
        return self._check(name, owner, entry)

    def _move(self, name: str, owner: str, entry: Entry, seconds: int) -> bool:
        """Put our key under a lease of its own of ``seconds`` (extend with a new TTL)."""
        lease = self.state.grant(name, seconds, private=True)
        reply = self._txn(
            name,
            txn(
                [created_at(entry.key, entry.revision)],
                [put(entry.key, lease.id)],
            ),
        )
        if not reply.succeeded:
            self.state.revoke_quietly(lease)
            self.state.forget(owner)
            return False
        old, entry.lease = entry.lease, lease
        if old.private:
            self.state.revoke_quietly(old)
        return True

    def _check(self, name: str, owner: str, entry: Entry) -> bool:
        reply = self._call(name, "kv", "Range", rpc.RangeRequest(key=entry.key, keys_only=True))
        if reply.kvs and reply.kvs[0].create_revision == entry.revision:
            return True
        self.state.forget(owner)
        return False

    def do_check(self, name: str, owner: str) -> bool:
        entry = self.state.entries.get(owner)
        return entry is not None and self._check(name, owner, entry)

    def do_break(self, name: str, token: int | None) -> bool:
        base, end, _ = self._names(name)
        while True:
            kvs, tokens = self.state.epochs.ranged(
                self._call,
                name,
                rpc.RangeRequest(key=base, range_end=end, limit=1, keys_only=True, **CREATE_ASC),
            )
            if not kvs:
                return False
            kv = kvs[0]
            if token is not None and tokens(kv.create_revision) != token:
                return False  # the holder is not the lease the caller meant
            deleted = self._txn(
                name, txn([created_at(kv.key, kv.create_revision)], [delete(kv.key)])
            )
            if deleted.succeeded:
                return True
            if token is not None:
                return False  # that lease ended meanwhile
            # That holder released meanwhile; break whoever holds it now.

    def do_ping(self) -> tuple[str, tuple[str, ...]]:
        reply = self._call("", "maintenance", "Status", rpc.StatusRequest())
        return f"etcd {reply.version}", ()

    def do_list(self, prefix: str) -> list[LockInfo]:
        start = self.root + escape(prefix)
        kvs, tokens = self.state.epochs.ranged(
            self._call,
            prefix or "*",
            rpc.RangeRequest(key=start, range_end=range_end(start), **CREATE_ASC),
        )
        holders: dict[bytes, Any] = {}
        for kv in kvs:
            base, _, _ = kv.key.rpartition(b"/")
            if len(base) <= len(self.root):
                continue  # not a lock's key: Pdlock/<name>/<lease>
            holders.setdefault(base, kv)  # ascending create revision: the first is the holder
        now = datetime.now(timezone.utc)
        ttls: dict[int, float] = {}
        infos = []
        for base, kv in holders.items():
            if kv.lease not in ttls:
                ttls[kv.lease] = self._remaining(prefix or "*", kv.lease)
            info = self._info(unescape(base[len(self.root) :]), kv, ttls[kv.lease], now, tokens)
            if info is not None:
                infos.append(info)
        return infos

    def do_get(self, name: str) -> LockInfo | None:
        """The live lease on ``name``: its oldest key, read in one range (with the epochs).

        The range covers ``Pdlock/N/`` only, so ``N/sub`` or ``Nx`` are not
        read. Its remaining time is asked of its lease, as :meth:`do_list` does.
        """
        base, end, _ = self._names(name)
        kvs, tokens = self.state.epochs.ranged(
            self._call, name, rpc.RangeRequest(key=base, range_end=end, limit=1, **CREATE_ASC)
        )
        if not kvs:
            return None
        kv = kvs[0]
        now = datetime.now(timezone.utc)
        return self._info(name, kv, self._remaining(name, kv.lease), now, tokens)

    def _remaining(self, name: str, lease_id: int) -> float:
        """Seconds lease ``lease_id`` has left by etcd (negative: gone; no lease: forever)."""
        if not lease_id:
            return math.inf
        reply = self._call(
            name, "lease", "LeaseTimeToLive", rpc.LeaseTimeToLiveRequest(ID=lease_id)
        )
        return float(reply.TTL)

    def _info(
        self, name: str, kv: Any, remaining: float, now: datetime, tokens: Callable[[int], int]
    ) -> LockInfo | None:
        """``kv``, the holder's key of ``name``, as a LockInfo; None if its lease is gone."""
        if remaining < 0:
            return None  # ran out between the two reads
        holder = load_holder(kv.value.decode(errors="replace"))
        return LockInfo(
            backend=self.alias,
            name=name,
            token=tokens(int(kv.create_revision)),
            holder=holder,
            acquired_at=_acquired_at(holder, now),
            expires_at=(
                now + timedelta(seconds=remaining)
                if math.isfinite(remaining)
                else datetime.max.replace(tzinfo=timezone.utc)
            ),
            expires_in=remaining,
        )


def _acquired_at(holder: dict[str, Any], default: datetime) -> datetime:
    """etcd keys carry no time; the holder's own ``acquired_at`` (its clock) is the best known."""
    text = holder.get("acquired_at")
    if isinstance(text, str):
        try:
            value = datetime.fromisoformat(text)
        except ValueError:
            return default
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return default
