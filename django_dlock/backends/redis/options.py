"""What the Redis backends check in their settings before anything connects.

Everything redis-py would refuse at the first command (a port out of range,
a ``db`` that is not a number, a timeout of ``inf``, a keyword argument no
connection class takes) is refused here, by the backend's constructor, as a
``LockConfigurationError``: ``manage.py check`` reports it with an id, and
``locks[alias]`` raises it instead of a ``ValueError`` from the first call.

The keyword arguments a client accepts are read from the signatures of the
redis-py installed, not from a list kept here.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
import socket
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio.connection as async_connection
import redis.cluster
from redis import connection as sync_connection
from redis.credentials import CredentialProvider

try:
    from redis import driver_info
except ImportError:  # redis-py before 7: no such argument
    driver_info = None  # type: ignore[assignment]

from ...exceptions import LockConfigurationError
from ..redaction import redacted

SCHEMES = ("redis", "rediss", "unix")
#: Client arguments the backend sets itself, so not accepted from
#: client_kwargs, and why.
OWN_ARGUMENTS = {
    "socket_timeout": "set OPTIONS['socket_timeout']: the backend's waits are derived from it",
    "socket_connect_timeout": "set OPTIONS['socket_connect_timeout']",
    "retry": "the backend resends a failed command once (a Redlock master: never)",
}
#: What redis-py reads in ``ssl_cert_reqs`` besides an ``ssl.VerifyMode``.
CERT_REQS = ("none", "optional", "required")
#: What Redis takes in CLIENT SETNAME: no spaces, newlines or other special characters.
_CLIENT_NAME = re.compile(r"[!-~]*")
#: The keepalive options ``socket_keepalive_options`` may set on this platform.
_KEEPALIVE = frozenset(
    getattr(socket, key)
    for key in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_KEEPALIVE")
    if hasattr(socket, key)
)
#: TLS files ``check()`` looks for.
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _parameters(*classes: type) -> set[str]:
    """The named keyword parameters of ``__init__`` along each class's MRO."""
    names: set[str] = set()
    for cls in classes:
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            for parameter in inspect.signature(init).parameters.values():
                if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                    names.add(parameter.name)
    names.discard("self")
    return names


@functools.cache
def accepted_arguments(scheme: str, *, cluster: bool, native_async: bool) -> frozenset[str]:
    """The client keyword arguments the installed redis-py takes for a URL of ``scheme``.

    ``Redis.from_url`` hands its keywords to the pool, which hands them to
    the connection class on the first connect (an unknown one is a
    ``TypeError`` then); a Cluster keeps those it knows and drops the rest
    without a word, so only those are accepted. With ``native_async`` the
    same keywords also make the redis.asyncio pool and its connections.
    """
    if cluster:
        known = set(getattr(redis.cluster, "REDIS_ALLOWED_KEYS", ()))
        known -= set(getattr(redis.cluster, "KWARGS_DISABLED_KEYS", ()))
        known |= _parameters(redis.cluster.RedisCluster) - {"url", "host", "port"}
        return frozenset(known)
    names = {"unix": "UnixDomainSocketConnection", "rediss": "SSLConnection"}
    name = names.get(scheme, "Connection")
    known = _parameters(getattr(sync_connection, name)) | {
        "max_connections",
        "connection_class",
        "single_connection_client",
    }
    if native_async:
        known &= _parameters(getattr(async_connection, name)) | {
            "max_connections",
            "connection_class",
            "single_connection_client",
        }
    return frozenset(known)


def _fail(alias: str, message: str) -> LockConfigurationError:
    return LockConfigurationError(f"Lock backend {alias!r}: {message}", alias=alias)


#: What ``parse_url`` reads from the URL itself rather than from its query.
_FROM_URL = frozenset({"host", "port", "path", "db", "username", "password", "connection_class"})


def check_url(alias: str, url: Any, *, cluster: bool, native_async: bool) -> dict[str, Any]:
    """The client arguments that redis-py reads from ``url``; raises for a URL it cannot use."""
    shown = redacted(url)
    if not isinstance(url, str) or url.split("://", 1)[0] not in SCHEMES or "://" not in url:
        raise _fail(alias, f"{shown} is not a redis://, rediss:// or unix:// URL.")
    parts = urlsplit(url)
    if "@" in url.partition("://")[2] and "@" not in parts.netloc:
        raise _fail(
            alias,
            f"{shown}: a '/', '?' or '#' in the user name or password must be "
            "percent-encoded (urllib.parse.quote(password, safe='')), or give the password "
            "in OPTIONS['client_kwargs']['password'].",
        )
    try:
        port = parts.port
    except ValueError:
        port = 0
    if parts.scheme != "unix":
        if not parts.hostname:
            raise _fail(alias, f"{shown} has no host.")
        if port == 0 or (port is None and parts.netloc.endswith(":")):
            raise _fail(alias, f"{shown}: the port must be a number from 1 to 65535.")
    elif not parts.path:
        raise _fail(alias, f"{shown}: a unix:// URL needs the socket's path.")
    try:
        options: dict[str, Any] = sync_connection.parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as e:
        # Its messages name the query parameter; never the password.
        raise _fail(alias, f"{shown}: {e}") from None
    if parts.scheme != "unix":
        path = parts.path.strip("/")
        if path and "db" not in options:
            raise _fail(alias, f"{shown}: the path must be the database number, such as /0.")
    if cluster and options.get("db"):
        raise _fail(alias, f"{shown}: a Redis Cluster has only database 0.")
    where = f"{shown} (its query)"
    query = {k: v for k, v in options.items() if k not in _FROM_URL}
    check_keys(alias, query, parts.scheme, where=where, cluster=cluster, native_async=native_async)
    check_arguments(alias, options, where=where)
    return options


def check_arguments(alias: str, kwargs: Mapping[str, Any], *, where: str) -> None:
    """Refuse client arguments whose values redis-py would fail on at connect time."""
    for key in ("socket_timeout", "socket_connect_timeout", "timeout"):
        value = kwargs.get(key)
        if value is not None and not _positive(value):
            raise _fail(alias, f"{key} in {where} must be a positive, finite number of seconds.")
    interval = kwargs.get("health_check_interval")
    if interval is not None and not (_positive(interval) or interval == 0):
        raise _fail(alias, f"health_check_interval in {where} must be a number of seconds >= 0.")
    if kwargs.get("protocol") not in (None, 2, 3, "2", "3"):
        raise _fail(alias, f"protocol in {where} must be 2 or 3 (RESP2 or RESP3).")
    name = kwargs.get("client_name")
    if name is not None and not (isinstance(name, str) and _CLIENT_NAME.fullmatch(name)):
        raise _fail(
            alias,
            f"client_name in {where} must be a str of printable ASCII without spaces "
            "(Redis refuses others in CLIENT SETNAME).",
        )
    version = kwargs.get("ssl_min_version")
    if version is not None and version not in set(ssl.TLSVersion):  # a URL gives an int
        raise _fail(alias, f"ssl_min_version in {where} must be an ssl.TLSVersion.")
    keepalive = kwargs.get("socket_keepalive_options")
    if keepalive is not None and not (
        isinstance(keepalive, Mapping)
        and all(
            k in _KEEPALIVE and type(v) is int and 1 <= v < 2**15 for k, v in keepalive.items()
        )
    ):
        raise _fail(
            alias,
            f"socket_keepalive_options in {where} must map socket.TCP_KEEPIDLE, "
            "TCP_KEEPINTVL or TCP_KEEPCNT to a number from 1 to 32767.",
        )
    if kwargs.get("socket_type") not in (None, 0, socket.AF_INET, socket.AF_INET6):
        raise _fail(alias, f"socket_type in {where} must be 0, socket.AF_INET or AF_INET6.")
    size = kwargs.get("socket_read_size")
    if size is not None and not (type(size) is int and size > 0):
        raise _fail(alias, f"socket_read_size in {where} must be a positive int.")
    provider = kwargs.get("credential_provider")
    if provider is not None and not isinstance(provider, CredentialProvider):
        raise _fail(alias, f"credential_provider in {where} must be a CredentialProvider.")
    info = kwargs.get("driver_info")
    if info is not None and not isinstance(info, getattr(driver_info, "DriverInfo", object)):
        raise _fail(alias, f"driver_info in {where} must be a redis.driver_info.DriverInfo.")
    for key in ("lib_name", "lib_version"):
        value = kwargs.get(key)
        if value is not None and not isinstance(value, str):
            raise _fail(alias, f"{key} in {where} must be a str.")
    for key, low in (("db", 0), ("max_connections", 1)):
        value = kwargs.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < low
        ):
            raise _fail(alias, f"{key} in {where} must be an int of at least {low}.")
    reqs = kwargs.get("ssl_cert_reqs")
    if isinstance(reqs, str) and reqs.lower() not in CERT_REQS:
        raise _fail(alias, f"ssl_cert_reqs in {where} must be one of {list(CERT_REQS)}.")
    connection_class = kwargs.get("connection_class")
    if connection_class is not None and not (
        isinstance(connection_class, type)
        and issubclass(connection_class, sync_connection.AbstractConnection)
    ):
        raise _fail(alias, f"connection_class in {where} must be a redis-py Connection class.")
    for key in ("username", "password", "ssl_password", *TLS_FILES):
        value = kwargs.get(key)
        if value is not None and not isinstance(value, str):
            raise _fail(alias, f"{key} in {where} must be a str.")


def check_client_kwargs(
    alias: str, client_kwargs: Any, schemes: set[str], *, cluster: bool, native_async: bool
) -> dict[str, Any]:
    """``OPTIONS['client_kwargs']``, refused if a client for one of ``schemes`` would be."""
    if not isinstance(client_kwargs, Mapping):
        raise _fail(alias, "OPTIONS['client_kwargs'] must be a dict.")
    for key in sorted(OWN_ARGUMENTS.keys() & set(client_kwargs)):
        raise _fail(alias, f"OPTIONS['client_kwargs'] must not set {key!r}; {OWN_ARGUMENTS[key]}.")
    for scheme in sorted(schemes):
        check_keys(
            alias,
            client_kwargs,
            scheme,
            where="OPTIONS['client_kwargs']",
            cluster=cluster,
            native_async=native_async,
        )
    check_arguments(alias, client_kwargs, where="OPTIONS['client_kwargs']")
    return dict(client_kwargs)


def check_keys(
    alias: str,
    kwargs: Mapping[str, Any],
    scheme: str,
    *,
    where: str,
    cluster: bool,
    native_async: bool,
) -> None:
    """Refuse keys of ``kwargs`` that a client for a ``scheme`` URL does not take."""
    accepted = accepted_arguments(scheme, cluster=cluster, native_async=native_async)
    unknown = sorted(key for key in kwargs if key not in accepted)
    if unknown:
        client = "a Redis Cluster client" if cluster else f"a {scheme}:// client"
        tls = scheme == "redis" and any(key.startswith("ssl") for key in unknown)
        raise _fail(
            alias,
            f"{where} has keys {unknown} that {client} of redis-py {redis.__version__} "
            f"does not take{' (for TLS, use a rediss:// URL)' if tls else ''}.",
        )


def tls_file_errors(alias: str, kwargs: Mapping[str, Any]) -> list[str]:
    """What is wrong with the TLS files named in ``kwargs`` (static: no connection)."""
    return [
        f"Lock backend {alias!r}: OPTIONS['client_kwargs'][{key!r}] {kwargs[key]!r} is not "
        "a readable file."
        for key in TLS_FILES
        if isinstance(kwargs.get(key), str) and not os.path.isfile(kwargs[key])
    ]


def _positive(value: Any) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value > 0
    )
