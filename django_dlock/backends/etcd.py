"""The etcd v3 backend: session leases, a revision-ordered queue, fencing by revision.

Settings::

    "BACKEND": "django_dlock.backends.etcd.EtcdBackend",
    "LOCATION": ["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"],
    "OPTIONS": {"ca": "/etc/etcd/ca.crt", "user": "app", "password": "..."},

``LOCATION`` is one endpoint or a list of them (``host:port``, ``http://host:port``
or ``https://host:port``); a request that fails on one member is sent to the
next. ``OPTIONS``: ``ca``, ``cert``, ``key`` (TLS files: the CA to trust, and a
client certificate and key), ``user`` and ``password`` (etcd authentication),
``timeout`` (seconds one operation may take, failover included; default 5).

The algorithm is etcd's own ``concurrency.Mutex``, the python-etcd recipe of
watching the predecessor, and ``contrib/lock``'s fencing by revision. For
``KEY_PREFIX`` P, lock name N (``%`` and ``/`` escaped as ``%25`` and ``%2F``)
and lease L in hex::

    Pdlock/N/L    value: holder JSON; attached to lease L

- **Session lease.** A process keeps one lease per backend and TTL (whole
  seconds, rounded up), kept alive by the watchdog while it holds locks and by
  the waiting thread while it waits, and revoked by ``close()`` and at exit.
  When one process waits for, or holds, the same name from several threads
  at once, each needs its own key, so it uses a second lease of that TTL (a
  third, ...). ``renew=False`` gets a lease of its own, revoked on release, so
  that it runs out after its TTL whatever the process's other locks do.
- **Acquire** is one transaction: put ``Pdlock/N/L`` if its create revision is
  0, and in the same transaction read the two newest keys under ``Pdlock/N/``
  by create revision. Inside the transaction ours is the newest, so the other
  is the key just ahead of ours; if there is none, ours has the lowest create
  revision: we hold the lock, and the **fencing token** is our key's create
  revision.
- **Waiting** watches the key just below ours for its delete (from the
  revision at which we saw it, so a delete in between is not missed), then
  re-checks in one transaction (is our key still there, and is any key older
  than it left?): the key ahead may have been a waiter that gave up.
  Waiters are therefore served strictly in arrival order.
- **Release** deletes our key if its create revision is still our token.
  A waiter that times out deletes its key; one that dies leaves it to expire
  with its lease.
- **List** is a range over the prefix; the holder of each name is its key with
  the lowest create revision. **Break** deletes that key, which wakes the
  next waiter.

So ``etcdctl lock Pdlock/N`` and this backend exclude each other, and
``etcdctl get --prefix Pdlock/`` shows holders and waiters.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple, TypeVar
from urllib.parse import unquote

from django.core import checks

from .._validation import load_holder
from ..exceptions import BackendUnavailable, LockNotOwned
from .base import BaseLockBackend, Grant, LockInfo

try:
    import grpc
    from etcd3 import etcdrpc as rpc
    from etcd3.etcdrpc import kv_pb2
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "The etcd lock backend needs etcd3-fc: pip install 'django-dlock[etcd]'"
    ) from e

#: gRPC codes after which the request goes to the next endpoint.
RETRY_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}
)
#: gRPC codes that no retry fixes: a wrong user or password (etcd answers
#: INVALID_ARGUMENT), a missing permission, a token that re-authenticating did
#: not renew. ``acquire()`` raises them at once.
REFUSED_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)
#: What ``acquire()`` retries while its timeout lasts: no answer, a deadline
#: passed, a leader being elected. Everything else (REFUSED_CODES, a lease TTL
#: too large, ...) is raised at once.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
#: Pause between rounds over every endpoint while a cluster elects a leader.
RETRY_PAUSE = 0.05
#: One try may take this share of an operation's ``timeout``. A request that a
#: member forwarded to a leader that has just died is dropped without an
#: answer; the next try, on the next member, reaches the new leader.
ATTEMPT_SHARE = 0.25

_CREATE_ASC = {"sort_order": rpc.RangeRequest.ASCEND, "sort_target": rpc.RangeRequest.CREATE}
_CREATE_DESC = {"sort_order": rpc.RangeRequest.DESCEND, "sort_target": rpc.RangeRequest.CREATE}
_DELETE = kv_pb2.Event.DELETE

T = TypeVar("T")


def _escape(name: str) -> bytes:
    return name.replace("%", "%25").replace("/", "%2F").encode()


def _unescape(part: bytes) -> str:
    return unquote(part.decode(errors="replace"))


def _range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _txn(compare: list[Any], success: list[Any], failure: list[Any] | None = None) -> Any:
    return rpc.TxnRequest(compare=compare, success=success, failure=failure or [])


def _created_at(key: bytes, revision: int) -> Any:
    return rpc.Compare(
        key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=revision
    )


def _leased_by(key: bytes, lease_id: int) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=lease_id)


def _get(key: bytes, end: bytes | None = None, **kwargs: Any) -> Any:
    request = rpc.RangeRequest(key=key, range_end=end or b"", **kwargs)
    return rpc.RequestOp(request_range=request)


def _delete(key: bytes) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def _seconds(ttl: float) -> int:
    """etcd leases are whole seconds; never shorter than asked."""
    return max(1, math.ceil(ttl))


@dataclass(eq=False)
class _Lease:
    id: int
    ttl: int
    #: ``time.monotonic()`` before which the lease cannot have run out on the server.
    expires: float
    #: Granted for one acquisition (``renew=False``, or moved by ``extend``).
    private: bool = False
    #: Lock keys (``Pdlock/N/``) that one of our acquisitions has under this lease.
    names: set[bytes] = field(default_factory=set)


@dataclass(eq=False)
class _Entry:
    """One acquisition of ours: queued or holding."""

    base: bytes
    key: bytes
    lease: _Lease
    #: Lease whose id names the key (the lease may since have moved).
    slot: _Lease
    revision: int = 0
    #: The key just ahead of ours and the revision at which we saw it.
    ahead: tuple[bytes, int] | None = None


class _NoReply(grpc.RpcError):  # type: ignore[misc]
    """A stream that ended without an answer: retried like an unreachable member."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)


class _LeaseNotFound(Exception):
    """A put named a lease that etcd no longer has."""


class _Wake:
    __slots__ = ("cancelled", "event", "watch_id")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.watch_id: int | None = None
        self.cancelled = False


class _Stubs(NamedTuple):
    kv: Any
    lease: Any
    watch: Any
    auth: Any
    maintenance: Any


class _Endpoint:
    def __init__(self, target: str, credentials: Any) -> None:
        self.target = target
        self.credentials = credentials
        self._stubs: _Stubs | None = None
        self._channel: Any = None
        self._mutex = threading.Lock()

    def stubs(self) -> _Stubs:
        """The stubs on this endpoint's channel, made on first use."""
        stubs = self._stubs
        if stubs is None:
            with self._mutex:
                if self._stubs is None:
                    options = [
                        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                        # After a member restarts, reconnect within a second
                        # rather than gRPC's default backoff of up to 120 s.
                        ("grpc.initial_reconnect_backoff_ms", 100),
                        ("grpc.min_reconnect_backoff_ms", 100),
                        ("grpc.max_reconnect_backoff_ms", 1000),
                    ]
                    if self.credentials is None:
                        channel = grpc.insecure_channel(self.target, options=options)
                    else:
                        channel = grpc.secure_channel(
                            self.target, self.credentials, options=options
                        )
                    self._channel = channel
                    self._stubs = _Stubs(
                        rpc.KVStub(channel),
                        rpc.LeaseStub(channel),
                        rpc.WatchStub(channel),
                        rpc.AuthStub(channel),
                        rpc.MaintenanceStub(channel),
                    )
                stubs = self._stubs
        return stubs

    def close(self) -> None:
        with self._mutex:
            channel, self._channel, self._stubs = self._channel, None, None
        if channel is not None:
            channel.close()


class _Transport:
    """Unary calls with failover across the endpoints, and the auth token."""

    def __init__(
        self,
        endpoints: list[_Endpoint],
        timeout: float,
        user: str | None,
        password: str | None,
    ) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self.user = user
        self.password = password
        self.current = 0
        self.metadata: tuple[tuple[str, str], ...] | None = None
        self._auth_mutex = threading.Lock()

    def stubs(self) -> _Stubs:
        return self.endpoints[self.current].stubs()

    def _auth_expired(self, error: grpc.RpcError) -> bool:
        """etcd dropped our auth token (it expires when unused, or the leader changed)."""
        return self.user is not None and (
            error.code() == grpc.StatusCode.UNAUTHENTICATED
            or "auth token" in (error.details() or "")
        )

    def _authenticate(self, auth_stub: Any, timeout: float) -> None:
        with self._auth_mutex:
            reply = auth_stub.Authenticate(
                rpc.AuthenticateRequest(name=self.user, password=self.password), timeout=timeout
            )
            self.metadata = (("token", reply.token),)

    def _retrying(
        self, send: Callable[[_Stubs, float, bool], T], ambiguous: list[bool] | None
    ) -> T:
        """``send(stubs, timeout, wait_for_ready)`` on the current endpoint, failing over.

        Each try gets ATTEMPT_SHARE of ``timeout``; the whole call, ``timeout``.
        Once every endpoint has failed, tries wait for a connection instead of
        failing at once (a member coming back). A try that failed may still
        have been applied; if the request is sent again, ``ambiguous`` (when
        given) gets True appended.
        """
        deadline = time.monotonic() + self.timeout
        tried = 0
        reauthenticated = False
        while True:
            index = self.current
            stubs = self.endpoints[index].stubs()
            timeout = max(min(deadline - time.monotonic(), self.timeout * ATTEMPT_SHARE), 0.001)
            try:
                if self.user is not None and self.metadata is None:
                    self._authenticate(stubs.auth, timeout)
                return send(stubs, timeout, tried >= len(self.endpoints))
            except grpc.RpcError as e:
                if not reauthenticated and self._auth_expired(e):
                    self.metadata = None
                    reauthenticated = True
                    continue
                if e.code() not in RETRY_CODES:
                    raise
                if self.current == index:
                    self.current = (index + 1) % len(self.endpoints)
                tried += 1
                if ambiguous is not None:
                    ambiguous.append(True)
                pause = RETRY_PAUSE if tried % len(self.endpoints) == 0 else 0.0
                if time.monotonic() + pause >= deadline:
                    raise
                if pause:
                    time.sleep(pause)

    def call(
        self, stub: str, method: str, request: Any, *, ambiguous: list[bool] | None = None
    ) -> Any:
        """``request`` to ``method`` of stub ``stub`` (a field of _Stubs), with failover."""
        return self._retrying(
            lambda stubs, timeout, wait: getattr(getattr(stubs, stub), method)(
                request, timeout=timeout, metadata=self.metadata, wait_for_ready=wait
            ),
            ambiguous,
        )

    def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; its new TTL, or 0 if it no longer exists."""

        def send(stubs: _Stubs, timeout: float, wait: bool) -> int:
            replies = stubs.lease.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                timeout=timeout,
                metadata=self.metadata,
                wait_for_ready=wait,
            )
            for reply in replies:
                return int(reply.TTL)
            # No answer is not "no lease" (that is TTL 0): try again.
            raise _NoReply("the keep-alive stream ended without an answer")

        return self._retrying(send, None)

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.close()


class _Watches:
    """One Watch stream per backend and process; each waiter watches one key.

    etcd answers create requests in order; like the Go client, this sends the
    next create only when the previous one is confirmed. Waiters do not wait
    for the confirmation: each watch starts at a past revision, so nothing
    that happens before it is established is missed.
    """

    def __init__(self, transport: _Transport) -> None:
        self._transport = transport
        self._mutex = threading.Lock()
        self._outbox: queue.SimpleQueue[Any] | None = None
        self._call: Any = None
        self._creating: deque[_Wake] = deque()
        self._held: deque[tuple[_Wake, Any]] = deque()
        self._active: dict[int, _Wake] = {}

    def watch(self, key: bytes, start_revision: int) -> _Wake:
        wake = _Wake()
        request = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=key,
                start_revision=start_revision,
                filters=[rpc.WatchCreateRequest.NOPUT],
            )
        )
        with self._mutex:
            if self._outbox is None:
                self._start()
            assert self._outbox is not None
            if self._creating:
                self._held.append((wake, request))
            else:
                self._creating.append(wake)
                self._outbox.put(request)
        return wake

    def cancel(self, wake: _Wake) -> None:
        with self._mutex:
            wake.cancelled = True
            if wake.watch_id is not None:
                if self._active.pop(wake.watch_id, None) is not None and self._outbox:
                    self._outbox.put(_cancel(wake.watch_id))
            else:
                self._held = deque(item for item in self._held if item[0] is not wake)

    def close(self) -> None:
        with self._mutex:
            outbox, self._outbox = self._outbox, None
            call, self._call = self._call, None
            wakes = self._drop_all()
        if outbox is not None:
            outbox.put(None)
        if call is not None:
            # etcd keeps a watch stream open after the client half-closes it.
            call.cancel()
        for wake in wakes:
            wake.event.set()

    def _drop_all(self) -> list[_Wake]:
        wakes = [*self._creating, *(w for w, _ in self._held), *self._active.values()]
        self._creating.clear()
        self._held.clear()
        self._active.clear()
        return wakes

    def _start(self) -> None:
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def requests() -> Iterator[Any]:
            while True:
                request = outbox.get()
                if request is None:
                    return
                yield request

        call = self._transport.stubs().watch.Watch(requests(), metadata=self._transport.metadata)
        self._outbox = outbox
        self._call = call
        thread = threading.Thread(
            target=self._run, args=(outbox, call), name="django-dlock-etcd-watch", daemon=True
        )
        thread.start()

    def _run(self, outbox: queue.SimpleQueue[Any], call: Any) -> None:
        try:
            for reply in call:
                self._handle(outbox, reply)
        except grpc.RpcError:
            pass  # every waiter re-checks below, and the next wait opens a new stream
        finally:
            with self._mutex:
                wakes = []
                if self._outbox is outbox:
                    self._outbox = None
                    self._call = None
                    wakes = self._drop_all()
            outbox.put(None)
            for wake in wakes:
                wake.event.set()

    def _handle(self, outbox: queue.SimpleQueue[Any], reply: Any) -> None:
        with self._mutex:
            if self._outbox is not outbox:
                return
            if reply.created:
                wake = self._creating.popleft() if self._creating else None
                if self._held:
                    nxt, request = self._held.popleft()
                    self._creating.append(nxt)
                    outbox.put(request)
                if wake is None:
                    return
                if reply.canceled or reply.compact_revision:
                    wake.event.set()  # e.g. compacted past our revision: re-check
                    return
                wake.watch_id = reply.watch_id
                if wake.cancelled:
                    outbox.put(_cancel(reply.watch_id))
                else:
                    self._active[reply.watch_id] = wake
                return
            wake = self._active.get(reply.watch_id)
            if wake is None:
                return
            if reply.canceled or any(event.type == _DELETE for event in reply.events):
                del self._active[reply.watch_id]
                if not reply.canceled:
                    outbox.put(_cancel(reply.watch_id))
                wake.event.set()


def _cancel(watch_id: int) -> Any:
    return rpc.WatchRequest(cancel_request=rpc.WatchCancelRequest(watch_id=watch_id))


class _State:
    """What one process knows: its transport, leases, acquisitions and watches."""

    def __init__(self, transport: _Transport) -> None:
        self.transport = transport
        self.watches = _Watches(transport)
        self.mutex = threading.Lock()
        #: TTL in seconds -> this process's session leases of that TTL
        self.sessions: dict[int, list[_Lease]] = {}
        #: owner token -> its acquisition
        self.entries: dict[str, _Entry] = {}
        #: key -> the compare that identifies our key (its create revision, or
        #: our session lease when the revision is unknown), for keys that a
        #: release or give-up could not delete (etcd unreachable) and that a
        #: session lease would keep alive
        self.orphans: dict[bytes, Any] = {}


_backends: weakref.WeakSet[EtcdBackend] = weakref.WeakSet()


def _reset_after_fork() -> None:
    # The parent's sessions, channels and acquisitions are the parent's.
    for backend in list(_backends):
        backend._state = None


def _close_at_exit() -> None:
    for backend in list(_backends):
        backend.close()


os.register_at_fork(after_in_child=_reset_after_fork)
atexit.register(_close_at_exit)


class EtcdBackend(BaseLockBackend):
    """Locks in etcd v3; see the module docstring for the algorithm and key layout."""

    supports_fair = True
    supports_shared_leases = True
    wakes_waiters = True
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
                raise self._config_error(f"OPTIONS[{key!r}] must be a str.")
        if ("cert" in options) != ("key" in options):
            raise self._config_error(
                "OPTIONS 'cert' and 'key' go together (a client certificate)."
            )
        if ("user" in options) != ("password" in options):
            raise self._config_error("OPTIONS 'user' and 'password' go together.")
        self.endpoints, self.secure = self._parse_location()
        self.root = f"{self.key_prefix}dlock/".encode()
        self._state: _State | None = None
        self._state_mutex = threading.Lock()
        # Building the keys and the range op shows in the uncontended cycle.
        self._names = functools.lru_cache(maxsize=4096)(self._make_names)
        _backends.add(self)

    def _parse_location(self) -> tuple[list[str], bool]:
        location = self.location if self.location is not None else "127.0.0.1:2379"
        if isinstance(location, str):
            items = [location]
        elif isinstance(location, Sequence) and location and not isinstance(location, bytes):
            items = list(location)
        else:
            raise self._config_error(
                "LOCATION must be an endpoint 'host:port' (or http:// / https:// URL) or a "
                "list of them."
            )
        schemes = set()
        endpoints = []
        for item in items:
            if not isinstance(item, str) or not item:
                raise self._config_error(f"{item!r} is not an etcd endpoint 'host:port'.")
            scheme, sep, rest = item.partition("://")
            if not sep:
                scheme, rest = "", item
            if scheme not in ("", "http", "https"):
                raise self._config_error(f"{item!r}: the scheme must be http or https.")
            host, colon, port = rest.rstrip("/").rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise self._config_error(f"{item!r} is not an etcd endpoint 'host:port'.")
            schemes.add(scheme)
            endpoints.append(f"{host}:{port}")
        tls_files = any(self.options.get(k) for k in ("ca", "cert", "key"))
        if "http" in schemes and (tls_files or "https" in schemes):
            raise self._config_error(
                "http:// endpoints do not use TLS; use https:// with OPTIONS 'ca'/'cert'/'key'."
            )
        return endpoints, "https" in schemes or tls_files

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
                raise self._config_error(f"cannot read OPTIONS[{key!r}]: {e}") from e

        return grpc.ssl_channel_credentials(
            root_certificates=read("ca"), private_key=read("key"), certificate_chain=read("cert")
        )

    @property
    def state(self) -> _State:
        state = self._state
        if state is None:
            with self._state_mutex:
                if self._state is None:
                    credentials = self._credentials()
                    transport = _Transport(
                        [_Endpoint(target, credentials) for target in self.endpoints],
                        self.timeout,
                        self.options.get("user"),
                        self.options.get("password"),
                    )
                    self._state = _State(transport)
                state = self._state
        return state

    def close(self) -> None:
        """Revoke this process's leases (held locks are released at once) and disconnect."""
        with self._state_mutex:
            state, self._state = self._state, None
        if state is None:
            return
        state.watches.close()
        # Do not hang an exiting process on an unreachable cluster.
        state.transport.timeout = min(state.transport.timeout, 1.0)
        with state.mutex:
            # _Lease compares by identity: a set holds each lease once.
            leases = {lease for ss in state.sessions.values() for lease in ss}
            leases.update(entry.lease for entry in state.entries.values())
            state.sessions.clear()
            state.entries.clear()
        for lease in leases:
            with contextlib.suppress(grpc.RpcError):  # it runs out by itself
                state.transport.call("lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease.id))
        state.transport.close()

    def _unavailable(self, name: str, error: grpc.RpcError) -> BackendUnavailable:
        details = error.details() if hasattr(error, "details") else str(error)
        what = f" for lock {name!r}" if name else ""
        code = error.code() if hasattr(error, "code") else None
        return BackendUnavailable(
            f"etcd at {', '.join(self.endpoints)} failed{what} on backend "
            f"{self.alias!r}: {code.name if code is not None else ''} {details}",
            name=name,
            backend=self.alias,
            # Only a service that did not answer (or is electing) is worth
            # waiting for; a refusal or a bad request (a lease TTL etcd will
            # not grant) fails the same way every time.
            transient=code in TRANSIENT_CODES,
        )

    def _call(self, name: str, stub: str, method: str, request: Any, **kwargs: Any) -> Any:
        state = self.state
        try:
            reply = state.transport.call(stub, method, request, **kwargs)
            if state.orphans:
                # etcd answers again: finish the releases that could not reach it.
                self._sweep_orphans()
            return reply
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND and "lease not found" in (e.details() or ""):
                raise _LeaseNotFound(e.details()) from e
            raise self._unavailable(name, e) from e

    def _txn(self, name: str, request: Any, **kwargs: Any) -> Any:
        return self._call(name, "kv", "Txn", request, **kwargs)

    # --- leases -----------------------------------------------------------------------

    def _grant(self, name: str, seconds: int, private: bool) -> _Lease:
        sent = time.monotonic()
        reply = self._call(name, "lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=seconds))
        if reply.error:
            raise BackendUnavailable(
                f"etcd refused a lease for lock {name!r} on backend {self.alias!r}: {reply.error}",
                name=name,
                backend=self.alias,
            )
        return _Lease(int(reply.ID), int(reply.TTL), sent + int(reply.TTL), private)

    def _keepalive(self, name: str, lease: _Lease) -> bool:
        """Refresh ``lease``; False if it had already run out."""
        sent = time.monotonic()
        try:
            ttl = self.state.transport.keepalive(lease.id)
        except grpc.RpcError as e:
            raise self._unavailable(name, e) from e
        if ttl <= 0:
            lease.expires = 0.0
            return False
        lease.ttl = ttl
        lease.expires = max(lease.expires, sent + ttl)
        return True

    def _revoke_quietly(self, lease: _Lease) -> None:
        # Not found (it ran out) or unreachable: it runs out by itself.
        with contextlib.suppress(grpc.RpcError):
            self.state.transport.call("lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease.id))

    def _take_slot(self, name: str, base: bytes, ttl: float, renew: bool) -> _Lease:
        """A lease under which ``base`` has no key of ours yet, fresh enough for ``ttl``."""
        seconds = _seconds(ttl)
        if not renew:
            lease = self._grant(name, seconds, private=True)
            lease.names.add(base)
            return lease
        state = self.state
        while True:
            now = time.monotonic()
            stale: _Lease | None = None
            with state.mutex:
                sessions = state.sessions.setdefault(seconds, [])
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
                lease = self._grant(name, seconds, private=False)
                with state.mutex:
                    lease.names.add(base)
                    state.sessions.setdefault(seconds, []).append(lease)
                return lease
            try:
                alive = stale.expires > time.monotonic() and self._keepalive(name, stale)
            except BaseException:
                self._free_slot(stale, base)
                raise
            if alive:
                return stale
            self._free_slot(stale, base)
            self._drop_session(stale)

    def _drop_session(self, lease: _Lease) -> None:
        """Take a session lease that ran out, or was revoked, out of reuse."""
        state = self.state
        with state.mutex:
            # Listed under the TTL asked for, which etcd may have raised.
            for sessions in state.sessions.values():
                if lease in sessions:
                    sessions.remove(lease)

    def _free_slot(self, lease: _Lease, base: bytes) -> None:
        with self.state.mutex:
            lease.names.discard(base)

    def _forget(self, owner: str, *, revoke: bool = True) -> _Entry | None:
        """Drop ``owner``'s acquisition; revoke its lease if it had one of its own."""
        state = self.state
        with state.mutex:
            entry = state.entries.pop(owner, None)
            if entry is not None:
                entry.slot.names.discard(entry.base)
        if revoke and entry is not None and entry.lease.private:
            self._revoke_quietly(entry.lease)
        return entry

    # --- primitives -------------------------------------------------------------------

    def _base(self, name: str) -> bytes:
        return self.root + _escape(name) + b"/"

    def _make_names(self, name: str) -> tuple[bytes, bytes, Any]:
        """``Pdlock/N/``, the end of its range, and the op that reads its two newest keys."""
        base = self._base(name)
        end = _range_end(base)
        return base, end, _get(base, end, limit=2, keys_only=True, **_CREATE_DESC)

    def do_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool = True
    ) -> int | Grant | None:
        state = self.state
        started = time.monotonic()
        entry = state.entries.get(owner)
        if entry is not None:
            return self._recheck(name, owner, entry, ttl)
        base, _, newest_two = self._names(name)
        lease = self._take_slot(name, base, ttl, renew)
        key = base + f"{lease.id:x}".encode()
        entry = _Entry(base, key, lease, lease)
        with state.mutex:
            state.entries[owner] = entry
        request = _txn(
            [_created_at(key, 0)],
            [
                rpc.RequestOp(
                    request_put=rpc.PutRequest(key=key, value=holder.encode(), lease=lease.id)
                ),
                # Within this transaction ours is the newest key under base:
                # the one before it is the key to watch, and if there is
                # none, ours is the lowest and we hold the lock.
                newest_two,
            ],
            [_get(key)],
        )
        try:
            for _ in range(3):
                retried: list[bool] = []
                reply = self._txn(name, request, ambiguous=retried)
                if reply.succeeded:
                    break
                [kv] = reply.responses[0].response_range.kvs or [None]
                if kv is not None and retried and kv.lease == lease.id:
                    # Our put was applied by the try that failed over: the key is ours.
                    entry.revision = kv.create_revision
                    return self._recheck(name, owner, entry, ttl)
                if kv is not None:
                    # Left by a release of ours that could not reach etcd: never
                    # reuse its revision as a token; delete it and put anew.
                    self._txn(name, _txn([_created_at(key, kv.create_revision)], [_delete(key)]))
            else:
                raise BackendUnavailable(
                    f"etcd key {key!r} for lock {name!r} on backend {self.alias!r} keeps "
                    "coming back.",
                    name=name,
                    backend=self.alias,
                )
        except _LeaseNotFound:
            # Revoked behind our back, or etcd lost its data: use a new lease.
            lease.expires = 0.0
            self._forget(owner)
            self._drop_session(lease)
            return self.do_acquire(name, owner, ttl, holder, renew)
        except BaseException:
            self._forget(owner)
            if not lease.private:
                # The put may have been applied (a timeout, a cancelled call):
                # the session lease would keep that key alive for good.
                self._delete_unknown(key, lease)
            raise
        entry.revision = reply.header.revision
        ahead = [kv for kv in reply.responses[1].response_range.kvs if kv.key != key]
        if not ahead:
            return self._granted(name, entry, ttl, started)
        entry.ahead = (ahead[0].key, reply.header.revision)
        return None

    def _recheck(self, name: str, owner: str, entry: _Entry, ttl: float) -> int | Grant | None:
        """After a wait: are we first now? If not, whom to watch next."""
        _, end, _ = self._names(name)
        reply = self._txn(
            name,
            _txn(
                [_created_at(entry.key, entry.revision)],
                [
                    # The newest key older than ours; none: ours is the lowest.
                    _get(
                        entry.base,
                        end,
                        limit=1,
                        keys_only=True,
                        max_create_revision=entry.revision - 1,
                        **_CREATE_DESC,
                    ),
                ],
            ),
        )
        if not reply.succeeded:
            # Our key is gone (its lease ran out, or someone broke the queue
            # entry): queue again at the back.
            self._forget(owner)
            return None
        ahead = reply.responses[0].response_range.kvs
        if not ahead:
            return self._granted(name, entry, ttl, None)
        entry.ahead = (ahead[0].key, reply.header.revision)
        return None

    def _granted(self, name: str, entry: _Entry, ttl: float, started: float | None) -> int | Grant:
        lease = entry.lease
        now = time.monotonic()
        if lease.expires - now < ttl / 2 and not self._keepalive(name, lease):
            # Cannot happen while the key exists; treat as a lease that ends now.
            return Grant(entry.revision, now, 0.001)
        if started is not None and lease.expires - lease.ttl >= started and lease.ttl >= ttl:
            # Granted or refreshed within this attempt: it runs at least ``ttl``
            # from when the caller sent the attempt.
            return entry.revision
        return Grant(entry.revision, lease.expires, max(lease.expires - now, 0.001))

    def wait(self, name: str, owner: str, remaining: float | None, attempt: int) -> None:
        """Watch the key ahead of ours for its delete; keep our lease alive meanwhile."""
        entry = self.state.entries.get(owner)
        if entry is None or entry.ahead is None:
            return
        lease = entry.lease
        refresh_in = lease.expires - time.monotonic() - lease.ttl / 2
        timeout = refresh_in if remaining is None else min(remaining, refresh_in)
        if timeout > 0:
            watches = self.state.watches
            wake = watches.watch(entry.ahead[0], entry.ahead[1] + 1)
            try:
                wake.event.wait(timeout)
            finally:
                watches.cancel(wake)
        if lease.expires - time.monotonic() <= lease.ttl / 2:
            self._keepalive(name, lease)

    def do_release(self, name: str, owner: str) -> bool:
        entry = self._forget(owner, revoke=False)
        if entry is None:
            return False
        retried: list[bool] = []
        reply = self._delete_entry(name, entry, ambiguous=retried)
        # A delete that failed over may have been applied by the first try.
        return bool(reply.succeeded) or bool(retried)

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
        self._forget(owner, revoke=False)
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
        lease = self._grant(name, _seconds(ttl), private=True)
        retried: list[bool] = []
        try:
            reply = self._txn(
                name,
                _txn(
                    [_created_at(key, revision), _leased_by(key, ticket_lease)],
                    [
                        rpc.RequestOp(
                            request_put=rpc.PutRequest(key=key, lease=lease.id, ignore_value=True)
                        )
                    ],
                    [_get(key, keys_only=True)],
                ),
                ambiguous=retried,
            )
        except BaseException:
            self._revoke_quietly(lease)
            raise
        moved = bool(reply.succeeded)
        if not moved and retried:
            # The try that failed over may have moved it for us.
            [kv] = reply.responses[0].response_range.kvs or [None]
            moved = kv is not None and kv.create_revision == revision and kv.lease == lease.id
        if not moved:
            self._revoke_quietly(lease)
            return False
        self._revoke_quietly(_Lease(ticket_lease, 0, 0.0, private=True))
        with self.state.mutex:
            self.state.entries[new_owner] = _Entry(base, key, lease, lease, revision)
        return True

    def do_release_ticket(self, name: str, owner: str, state: Any) -> bool:
        _, key, revision, ticket_lease = self._ticket(name, state)
        retried: list[bool] = []
        reply = self._txn(
            name,
            _txn(
                [_created_at(key, revision), _leased_by(key, ticket_lease)],
                [_delete(key)],
                [_get(key, keys_only=True)],
            ),
            ambiguous=retried,
        )
        self._revoke_quietly(_Lease(ticket_lease, 0, 0.0, private=True))
        # A try that failed over may have deleted it: then the key is gone.
        if reply.succeeded:
            return True
        return bool(retried) and not reply.responses[0].response_range.kvs

    def do_abandon(self, name: str, owner: str) -> None:
        entry = self._forget(owner, revoke=False)
        if entry is not None:
            self._delete_entry(name, entry)

    def _delete_entry(self, name: str, entry: _Entry, **kwargs: Any) -> Any:
        """Delete our key if it is still the one we created; revoke a lease of its own."""
        try:
            return self._txn(
                name,
                _txn([_created_at(entry.key, entry.revision)], [_delete(entry.key)]),
                **kwargs,
            )
        except BackendUnavailable:
            if not entry.lease.private:
                # The session lease would keep the key alive: delete it later.
                self.state.orphans[entry.key] = _created_at(entry.key, entry.revision)
            raise
        finally:
            if entry.lease.private:
                self._revoke_quietly(entry.lease)

    def _delete_unknown(self, key: bytes, lease: _Lease) -> None:
        """Delete ``key`` if our ``lease`` holds it; quietly, later if etcd is unreachable."""
        ours = _leased_by(key, lease.id)
        try:
            self.state.transport.call("kv", "Txn", _txn([ours], [_delete(key)]))
        except grpc.RpcError:
            self.state.orphans[key] = ours

    def _sweep_orphans(self) -> None:
        """Delete keys that an earlier release could not; quietly, stopping at an error."""
        orphans = self.state.orphans
        for key, ours in list(orphans.items()):
            try:
                self.state.transport.call("kv", "Txn", _txn([ours], [_delete(key)]))
            except grpc.RpcError:
                return  # unreachable again; the next call that gets through tries again
            orphans.pop(key, None)

    def do_extend(self, name: str, owner: str, ttl: float) -> bool:
        entry = self.state.entries.get(owner)
        if entry is None:
            return False
        seconds = _seconds(ttl)
        if seconds != entry.lease.ttl:
            return self._move(name, owner, entry, seconds)
        if not self._keepalive(name, entry.lease):
            self._forget(owner)
            return False
        return self._check(name, owner, entry)

    def _move(self, name: str, owner: str, entry: _Entry, seconds: int) -> bool:
        """Put our key under a lease of its own of ``seconds`` (extend with a new TTL)."""
        lease = self._grant(name, seconds, private=True)
        reply = self._txn(
            name,
            _txn(
                [_created_at(entry.key, entry.revision)],
                [
                    rpc.RequestOp(
                        request_put=rpc.PutRequest(
                            key=entry.key, lease=lease.id, ignore_value=True
                        )
                    )
                ],
            ),
        )
        if not reply.succeeded:
            self._revoke_quietly(lease)
            self._forget(owner)
            return False
        old, entry.lease = entry.lease, lease
        if old.private:
            self._revoke_quietly(old)
        return True

    def _check(self, name: str, owner: str, entry: _Entry) -> bool:
        reply = self._call(name, "kv", "Range", rpc.RangeRequest(key=entry.key, keys_only=True))
        if reply.kvs and reply.kvs[0].create_revision == entry.revision:
            return True
        self._forget(owner)
        return False

    def do_check(self, name: str, owner: str) -> bool:
        entry = self.state.entries.get(owner)
        return entry is not None and self._check(name, owner, entry)

    def do_break(self, name: str, token: int | None) -> bool:
        base, end, _ = self._names(name)
        while True:
            reply = self._call(
                name,
                "kv",
                "Range",
                rpc.RangeRequest(key=base, range_end=end, limit=1, keys_only=True, **_CREATE_ASC),
            )
            if not reply.kvs:
                return False
            kv = reply.kvs[0]
            if token is not None and kv.create_revision != token:
                return False  # the holder is not the lease the caller meant
            deleted = self._txn(
                name, _txn([_created_at(kv.key, kv.create_revision)], [_delete(kv.key)])
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
        start = self.root + _escape(prefix)
        reply = self._call(
            prefix or "*",
            "kv",
            "Range",
            rpc.RangeRequest(key=start, range_end=_range_end(start), **_CREATE_ASC),
        )
        holders: dict[bytes, Any] = {}
        for kv in reply.kvs:
            base, _, _ = kv.key.rpartition(b"/")
            if len(base) <= len(self.root):
                continue  # not a lock's key: Pdlock/<name>/<lease>
            holders.setdefault(base, kv)  # ascending create revision: the first is the holder
        now = datetime.now(timezone.utc)
        ttls: dict[int, int] = {}
        infos = []
        for base, kv in holders.items():
            if kv.lease and kv.lease not in ttls:
                info = self._call(
                    prefix or "*",
                    "lease",
                    "LeaseTimeToLive",
                    rpc.LeaseTimeToLiveRequest(ID=kv.lease),
                )
                ttls[kv.lease] = int(info.TTL)
            remaining = float(ttls[kv.lease]) if kv.lease else math.inf
            if remaining < 0:
                continue  # ran out between the two reads
            holder = load_holder(kv.value.decode(errors="replace"))
            infos.append(
                LockInfo(
                    backend=self.alias,
                    name=_unescape(base[len(self.root) :]),
                    token=int(kv.create_revision),
                    holder=holder,
                    acquired_at=_acquired_at(holder, now),
                    expires_at=(
                        now + timedelta(seconds=remaining)
                        if math.isfinite(remaining)
                        else datetime.max.replace(tzinfo=timezone.utc)
                    ),
                    expires_in=remaining,
                )
            )
        return infos


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
