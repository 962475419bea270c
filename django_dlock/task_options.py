"""The lock options both task decorators take: Celery's and the task framework's.

``django_dlock.celery`` and ``django_dlock.tasks`` each validate their
``LockOptions`` here first, then add the rules of their own (Celery's
``retry``, ``countdown`` and ``defer``; the task framework's refusal of them).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import conf
from ._validation import validate_timeout, validate_ttl
from .backends.slots import SlotView, validate_limit
from .exceptions import LockConfigurationError
from .handle import HeldLock
from .handler import locks
from .keys import KeyTemplate, templated

SCOPES = ("run", "queue")

logger = logging.getLogger("django_dlock.tasks")


@dataclass(frozen=True)
class TaskLockOptions:
    """The options both decorators take, validated (each subclasses it as ``LockOptions``)."""

    key: str | None = None
    ttl: float | None = None
    backend: str = conf.DEFAULT_ALIAS
    on_locked: str = "skip"
    scope: str = "run"
    timeout: float | None = None
    limit: int | None = None

    def target(self) -> Any:
        """The backend to acquire on: the alias's, or its semaphore view with ``limit``."""
        return lock_target(self.backend, self.limit)


def parse_common(
    value: Mapping[str, Any], task: str, known: Iterable[str], on_locked: tuple[str, ...]
) -> dict[str, Any]:
    """``key``, ``ttl``, ``backend``, ``on_locked``, ``scope``, ``timeout`` and ``limit``, checked.

    ``known`` are the option names the caller takes, ``on_locked`` its values
    of that option; errors name ``task``.
    """
    known = set(known)
    unknown = sorted(set(value) - known)
    if unknown:
        raise TypeError(
            f"Unknown lock options {unknown!r} for {task}; the options are {sorted(known)!r}."
        )
    key = value.get("key")
    if key is not None and (not isinstance(key, str) or not key):
        raise TypeError(f"lock key of {task} must be a non-empty str template.")
    ttl = value.get("ttl")
    backend = value.get("backend", conf.DEFAULT_ALIAS)
    if not isinstance(backend, str):
        raise TypeError(f"lock backend of {task} must be an alias (str), not {backend!r}.")
    when_locked = value.get("on_locked", "skip")
    if when_locked not in on_locked:
        raise ValueError(f"on_locked of {task} must be one of {on_locked!r}, not {when_locked!r}.")
    scope = value.get("scope", "run")
    if scope not in SCOPES:
        raise ValueError(f"scope of {task} must be one of {SCOPES!r}, not {scope!r}.")
    if "timeout" in value and when_locked != "wait":
        raise ValueError(f"timeout applies to on_locked='wait' only ({task}).")
    limit = value.get("limit")
    return {
        "key": key,
        "ttl": None if ttl is None else validate_ttl(ttl),
        "backend": backend,
        "on_locked": when_locked,
        "scope": scope,
        "timeout": validate_timeout(value.get("timeout")),
        "limit": None if limit is None else validate_limit(limit),
    }


def lock_target(backend: str, limit: int | None) -> Any:
    """The backend to acquire on: the alias's, or its semaphore view with ``limit``."""
    lock_backend = locks[backend]
    return lock_backend if limit is None else SlotView(lock_backend, limit, 1)


def hashed_key(task: str, arguments: Mapping[str, Any]) -> str:
    """The default key of a call: ``task``, then a hash of its arguments' JSON.

    SHA-256, so the key is the same in every process (``hash()`` is not).
    """
    try:
        text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=repr)
    except (TypeError, ValueError):
        text = repr(sorted(arguments.items(), key=lambda item: item[0]))
    return f"{task}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def call_key(template: KeyTemplate, task: str, args: Any, kwargs: Any) -> str:
    """The lock name of a call of ``task``: its key ``template`` filled, else ``hashed_key``.

    A task without a ``key`` has a template of ``""``, which only binds the arguments.
    """
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if template.template:
        return template.format(args, kwargs)
    return hashed_key(task, template.arguments(args, kwargs))


def adopt_ticket(
    ticket: Mapping[str, Any], alias: str, ttl: float | None, pattern: str
) -> HeldLock:
    """Adopt a queue lease's ``ticket`` on the task's backend ``alias``, labelled ``pattern``.

    Only on ``alias``, the lock backend the task is configured with: a ticket
    naming any other alias is not this task's lease, whatever it says, and
    adopting it there would run the body while the task's own key may be held.
    Raises ``LockLost`` if it ran out, was broken or was adopted already, and
    ``MalformedTicket`` for one that is not a ticket of ours: a forged or stale
    one, or one naming another backend alias.
    """
    try:
        named = ticket["backend"]
        if named != alias:
            raise ValueError(
                f"the ticket names lock backend {named!r}, not the task's own {alias!r}"
            )
        backend = locks[alias]
        with templated(pattern):
            return backend.adopt(ticket, ttl=ttl or backend.default_ttl)
    except (KeyError, TypeError, ValueError, LockConfigurationError) as e:
        raise MalformedTicket(str(e)) from e


def skipped_by(alias: str, key: str, limit: int | None) -> dict[str, Any] | None:
    """Who holds ``key``, for a skipped call's log line and ``task_skipped``; one lookup.

    The holder metadata of the lease on ``alias`` (host, pid, and what the
    holder said: a view's path, another task's id), or None if it cannot be
    told: a semaphore (``limit``), a lease that ended meanwhile, or a lookup
    that failed. Never raises: it only explains a skip.
    """
    if limit is not None:
        return None
    try:
        info = locks[alias].get(key)
    except Exception:
        logger.debug("Could not look up the holder of %r on %r", key, alias, exc_info=True)
        return None
    return None if info is None else dict(info.holder)


class MalformedTicket(ValueError):
    """A ticket that cannot be adopted whatever the lock service says."""
