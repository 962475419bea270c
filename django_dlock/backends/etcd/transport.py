"""The etcd backend's gRPC transport: channels, stubs, calls with failover, errors.

A :class:`Transport` sends unary requests to the current endpoint and, when
that member does not answer, to the next; it authenticates when ``user`` is
set, and maps a failed call to :class:`~django_dlock.exceptions.BackendUnavailable`
(transient when etcd did not answer or is electing, :data:`TRANSIENT_CODES`).
The helpers below it build the requests the backend sends.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar
from urllib.parse import unquote

import grpc

from ...exceptions import BackendUnavailable
from ..redaction import redacted
from . import etcdrpc as rpc

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

#: Range options: oldest key first, or newest first, by create revision.
CREATE_ASC = {"sort_order": rpc.RangeRequest.ASCEND, "sort_target": rpc.RangeRequest.CREATE}
CREATE_DESC = {"sort_order": rpc.RangeRequest.DESCEND, "sort_target": rpc.RangeRequest.CREATE}

T = TypeVar("T")


class NoReply(grpc.RpcError):  # type: ignore[misc]
    """A stream that ended without an answer: retried like an unreachable member."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)


class LeaseNotFound(Exception):
    """A put named a lease that etcd no longer has."""


class RawKV:
    """KV's ``Txn`` taking the request already encoded (see :func:`queue_txn`)."""

    def __init__(self, channel: Any) -> None:
        self.Txn = channel.unary_unary(
            "/etcdserverpb.KV/Txn",
            request_serializer=None,  # bytes go out as they are
            response_deserializer=rpc.TxnResponse.FromString,
        )


class Stubs(NamedTuple):
    """The gRPC services of one endpoint, on one channel."""

    kv: Any
    lease: Any
    watch: Any
    auth: Any
    maintenance: Any
    raw_kv: RawKV


class Endpoint:
    """One member's address and its channel, opened on first use."""

    def __init__(self, target: str, credentials: Any) -> None:
        self.target = target
        self.credentials = credentials
        self._stubs: Stubs | None = None
        self._channel: Any = None
        self._mutex = threading.Lock()

    def stubs(self) -> Stubs:
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
                    self._stubs = Stubs(
                        rpc.KVStub(channel),
                        rpc.LeaseStub(channel),
                        rpc.WatchStub(channel),
                        rpc.AuthStub(channel),
                        rpc.MaintenanceStub(channel),
                        RawKV(channel),
                    )
                stubs = self._stubs
        return stubs

    def close(self) -> None:
        with self._mutex:
            channel, self._channel, self._stubs = self._channel, None, None
        if channel is not None:
            channel.close()


class Transport:
    """Unary calls with failover across the endpoints, and the auth token.

    ``alias`` names the backend in the errors :meth:`request` raises.
    """

    def __init__(
        self,
        alias: str,
        endpoints: list[Endpoint],
        timeout: float,
        user: str | None,
        password: str | None,
    ) -> None:
        self.alias = alias
        self.endpoints = endpoints
        self.timeout = timeout
        self.user = user
        self.password = password
        self.current = 0
        #: Calls that failed (a member down, or etcd restarted): see ``epochs.py``.
        self.failures = 0
        self.metadata: tuple[tuple[str, str], ...] | None = None
        self._auth_mutex = threading.Lock()

    def stubs(self) -> Stubs:
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
        self, send: Callable[[Stubs, float, bool], T], ambiguous: list[bool] | None
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
                self.failures += 1
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
        """``request`` to ``method`` of stub ``stub`` (a field of Stubs), with failover.

        A failure is raised as gRPC's own ``RpcError``; :meth:`request` maps it.
        """
        # wait_for_ready None is gRPC's default, failing fast as False does,
        # without a flags object made per call.
        return self._retrying(
            lambda stubs, timeout, wait: getattr(getattr(stubs, stub), method)(
                request, timeout=timeout, metadata=self.metadata, wait_for_ready=wait or None
            ),
            ambiguous,
        )

    def request(self, name: str, stub: str, method: str, request: Any, **kwargs: Any) -> Any:
        """:meth:`call`, raising ``LeaseNotFound`` or ``BackendUnavailable`` for lock ``name``."""
        try:
            return self.call(stub, method, request, **kwargs)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND and "lease not found" in (e.details() or ""):
                raise LeaseNotFound(e.details()) from e
            raise self.unavailable(name, e) from e

    def unavailable(self, name: str, error: grpc.RpcError) -> BackendUnavailable:
        """The error to raise for a call about lock ``name`` (``""``: none) that failed."""
        details = error.details() if hasattr(error, "details") else str(error)
        what = f" for lock {name!r}" if name else ""
        code = error.code() if hasattr(error, "code") else None
        targets = ", ".join(endpoint.target for endpoint in self.endpoints)
        return BackendUnavailable(
            f"etcd at {targets} failed{what} on backend "
            f"{self.alias!r}: {code.name if code is not None else ''} {details}",
            name=name,
            backend=self.alias,
            # Only a service that did not answer (or is electing) is worth
            # waiting for; a refusal or a bad request (a lease TTL etcd will
            # not grant) fails the same way every time.
            transient=code in TRANSIENT_CODES,
        )

    def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; its new TTL, or 0 if it no longer exists."""

        def send(stubs: Stubs, timeout: float, wait: bool) -> int:
            replies = stubs.lease.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                timeout=timeout,
                metadata=self.metadata,
                wait_for_ready=wait,
            )
            for reply in replies:
                return int(reply.TTL)
            # No answer is not "no lease" (that is TTL 0): try again.
            raise NoReply("the keep-alive stream ended without an answer")

        return self._retrying(send, None)

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.close()


# --- requests -----------------------------------------------------------------------------


def escape(name: str) -> bytes:
    """A lock name as one key segment: ``%`` and ``/`` written ``%25`` and ``%2F``."""
    return name.replace("%", "%25").replace("/", "%2F").encode()


def unescape(part: bytes) -> str:
    """The name :func:`escape` wrote as ``part``."""
    return unquote(part.decode(errors="replace"))


def range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def txn(compare: list[Any], success: list[Any], failure: list[Any] | None = None) -> Any:
    """A transaction: ``success`` if every ``compare`` holds, else ``failure``."""
    return rpc.TxnRequest(compare=compare, success=success, failure=failure or [])


def created_at(key: bytes, revision: int) -> Any:
    """Compare: ``key``'s create revision is ``revision`` (0: the key does not exist)."""
    return rpc.Compare(
        key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=revision
    )


def modified_at(key: bytes, revision: int) -> Any:
    """Compare: ``key`` was last written at ``revision``."""
    return rpc.Compare(
        key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision
    )


def leased_by(key: bytes, lease_id: int) -> Any:
    """Compare: ``key`` is attached to lease ``lease_id``."""
    return rpc.Compare(key=key, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=lease_id)


def get(key: bytes, end: bytes | None = None, **kwargs: Any) -> Any:
    """Op: read ``key`` (or the range up to ``end``); ``kwargs`` go to ``RangeRequest``."""
    request = rpc.RangeRequest(key=key, range_end=end or b"", **kwargs)
    return rpc.RequestOp(request_range=request)


def put(key: bytes, lease_id: int, value: bytes | None = None) -> Any:
    """Op: put ``key`` under lease ``lease_id``; without ``value``, keep the value it has."""
    if value is None:
        request = rpc.PutRequest(key=key, lease=lease_id, ignore_value=True)
    else:
        request = rpc.PutRequest(key=key, value=value, lease=lease_id)
    return rpc.RequestOp(request_put=request)


def delete(key: bytes) -> Any:
    """Op: delete ``key``."""
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


# --- the two transactions of every acquisition, encoded by hand -----------------------------
#
# Queueing a key and deleting it are the two requests of every uncontended
# acquire/release cycle. Built as messages they take seven protobuf objects,
# each copied into its parent, which cost more than the rest of the cycle's
# Python; written straight in protobuf's wire format they are a few byte
# joins. Each function returns exactly ``txn(...).SerializeToString()`` of the
# request named in its docstring (tests/test_etcd.py compares them), to be
# sent with ``call("raw_kv", "Txn", ...)``. Field numbers are etcd's
# ``rpc.proto``; a length-delimited field is its tag, the payload's length as
# a varint, and the payload; fields at their default (0, empty) are left out.


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (``tag`` already encoded), left out when empty."""
    return tag + _varint(len(payload)) + payload if payload else b""


def _number(tag: bytes, n: int) -> bytes:
    """A varint field (``tag`` already encoded), left out when 0."""
    return tag + _varint(n) if n else b""


def _created_at(key: bytes, revision: int) -> bytes:
    """TxnRequest.compare (1): Compare target CREATE (2 = 1), key (3), create_revision (5).

    ``create_revision`` is one of a oneof, so it is written even when 0.
    """
    return _field(b"\x0a", b"\x10\x01" + _field(b"\x1a", key) + b"\x28" + _varint(revision))


def encode_op(op: Any) -> bytes:
    """A RequestOp message as an item of TxnRequest.success (2)."""
    return _field(b"\x12", op.SerializeToString())


def queue_txn(key: bytes, lease_id: int, value: bytes, read: bytes) -> bytes:
    """``txn([created_at(key, 0)], [put(key, lease_id, value), <read>], [get(key)])``.

    ``read`` is a RequestOp as :func:`encode_op` wrote it.
    """
    compare, key_field, lease_field, get_key = _queue_parts(key, lease_id)
    # RequestOp.request_put (2): PutRequest key (1), value (2), lease (3).
    put = key_field + _field(b"\x12", value) + lease_field
    return compare + _field(b"\x12", _field(b"\x12", put)) + read + get_key


@functools.lru_cache(maxsize=4096)
def _queue_parts(key: bytes, lease_id: int) -> tuple[bytes, bytes, bytes, bytes]:
    """What :func:`queue_txn` writes the same for every value: a key is put again and again."""
    return (
        _created_at(key, 0),
        _field(b"\x0a", key),
        _number(b"\x18", lease_id),
        # TxnRequest.failure (3): RequestOp.request_range (1): RangeRequest key (1).
        _field(b"\x1a", _field(b"\x0a", _field(b"\x0a", key))),
    )


def delete_txn(key: bytes, revision: int) -> bytes:
    """``txn([created_at(key, revision)], [delete(key)])``."""
    compare, success = _delete_parts(key)
    compare += b"\x28" + _varint(revision)  # Compare.create_revision (5)
    return b"\x0a" + _varint(len(compare)) + compare + success


@functools.lru_cache(maxsize=4096)
def _delete_parts(key: bytes) -> tuple[bytes, bytes]:
    """What :func:`delete_txn` writes the same for every revision."""
    return (
        # Compare target CREATE (2 = 1) and key (3), before create_revision.
        b"\x10\x01" + _field(b"\x1a", key),
        # TxnRequest.success (2): RequestOp.request_delete_range (3): key (1).
        _field(b"\x12", _field(b"\x1a", _field(b"\x0a", key))),
    )


def parse_location(location: Any, options: Mapping[str, Any]) -> tuple[list[str], bool]:
    """LOCATION's endpoints ("host:port") and whether they use TLS; ValueError if malformed."""
    location = location if location is not None else "127.0.0.1:2379"
    if isinstance(location, str):
        items = [location]
    elif isinstance(location, Sequence) and location and not isinstance(location, bytes):
        items = list(location)
    else:
        raise ValueError(
            "LOCATION must be an endpoint 'host:port' (or http:// / https:// URL) or a "
            "list of them."
        )
    schemes = set()
    endpoints = []
    for item in items:
        shown = redacted(item)
        if not isinstance(item, str) or not item:
            raise ValueError(f"{shown} is not an etcd endpoint 'host:port'.")
        scheme, sep, rest = item.partition("://")
        if not sep:
            scheme, rest = "", item
        if scheme not in ("", "http", "https"):
            raise ValueError(f"{shown}: the scheme must be http or https.")
        if "@" in rest:
            # gRPC would take "user:password@host" for a host name, and every
            # message naming the endpoint would show the password.
            raise ValueError(
                f"{shown}: an etcd endpoint takes no user name or password; give them "
                "as OPTIONS 'user' and 'password'."
            )
        host, colon, port = rest.rstrip("/").rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{shown} is not an etcd endpoint 'host:port' (a port 1-65535).")
        schemes.add(scheme)
        endpoints.append(f"{host}:{port}")
    tls_files = any(options.get(k) for k in ("ca", "cert", "key"))
    if "http" in schemes and (tls_files or "https" in schemes):
        raise ValueError(
            "http:// endpoints do not use TLS; use https:// with OPTIONS 'ca'/'cert'/'key'."
        )
    return endpoints, "https" in schemes or tls_files
