"""The lock policy of a locked task, written once for Celery and Django's task framework.

``django_dlock.celery`` and ``django_dlock.task_framework`` are adapters: each
hooks into its framework (Celery's ``__call__``/``apply_async``, the task
framework's ``call``/``enqueue``) and asks a :class:`TaskPolicy` for what is
the same in both:

- the options: :func:`lock_options_given` gathers them from the decorator's
  keywords and ``lock={...}``, :func:`parse_common` validates those both take
  (each adapter then adds its own rules: Celery's ``retry``, ``countdown``
  and ``defer``, the task framework's refusal of them);
- the key: :func:`caller_template` over the arguments callers pass, and
  :func:`call_key` for one call (the template filled, else a hash);
- the lease: :meth:`TaskPolicy.acquire` takes it, or does what ``on_locked``
  says (``raise``/``wait`` raise ``LockTimeout``, ``skip`` logs and sends
  ``task_skipped``; Celery's ``retry`` and ``defer`` are its own, given as
  ``refused``); :meth:`TaskPolicy.adopt` takes over a queue lease's ticket;
  :meth:`TaskPolicy.release_ticket` gives one back;
- the holder metadata every task lease carries, and :func:`seconds_until`,
  how long an enqueued call waits before it may run (the queue lease covers it).

:func:`acquire_lease` and :func:`adopt_lease` are the only places that turn
the options into a call on the lock backend.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, time, timezone, tzinfo
from typing import Any

from django.utils import timezone as dj_timezone

from . import conf
from ._validation import validate_timeout, validate_ttl
from .backends.limits import validate_limit
from .exceptions import LockConfigurationError, LockLost, LockTimeout
from .handler import locks
from .held import HeldLock
from .keys import KeyTemplate
from .signals import task_skipped

SCOPES = ("run", "queue")


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


def lock_options_given(options: dict[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """The lock options given to a decorator: ``lock={...}`` and the keywords named in ``fields``.

    Takes them out of ``options``, which keeps the framework's own options.
    """
    given = options.pop("lock", None) or {}
    if not isinstance(given, Mapping):
        raise TypeError(f"lock options must be a dict, not {type(given).__name__}.")
    lock = dict(given)
    for name in fields:
        if name in options:
            if name in lock:
                raise TypeError(f"Lock option {name!r} is given twice.")
            lock[name] = options.pop(name)
    return lock


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
    if scope == "queue" and limit is not None:
        raise ValueError(
            f"limit applies to scope='run' only ({task}): a semaphore's slot cannot "
            "travel with a message or an enqueued task."
        )
    return {
        "key": key,
        "ttl": None if ttl is None else validate_ttl(ttl),
        "backend": backend,
        "on_locked": when_locked,
        "scope": scope,
        "timeout": validate_timeout(value.get("timeout")),
        "limit": None if limit is None else validate_limit(limit),
    }


# --- keys ---------------------------------------------------------------------------------


def caller_template(key: str | None, func: Callable[..., Any], drop_first: bool) -> KeyTemplate:
    """``key`` over the arguments callers pass to ``func``.

    ``drop_first``: the first parameter is not the caller's (a bound Celery
    task's ``self``, a task framework's ``context``). Without a key the
    template only binds the arguments, for the default key's hash. Raises
    where the task is defined for a key naming no argument.
    """
    signature = inspect.signature(func)
    if drop_first:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return KeyTemplate(key or "", signature, func.__qualname__)


def hashed_key(task: str, arguments: Mapping[str, Any]) -> str:
    """The default key of a call: ``task``, then a hash of its arguments' JSON.

    SHA-256, so the key is the same in every process (``hash()`` is not).
    A date or time is hashed as its ISO text: a message brings an aware
    datetime back with a fixed-offset tzinfo, whose ``repr`` differs from the
    caller's ``zoneinfo`` one, and the worker would compute another key.
    """
    try:
        text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=_json_default)
    except (TypeError, ValueError):
        text = repr(sorted(arguments.items(), key=lambda item: item[0]))
    return f"{task}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def _json_default(value: Any) -> str:
    if isinstance(value, datetime) and value.utcoffset() is not None:
        # One instant, one key, whatever zone it was written in.
        return value.astimezone(timezone.utc).isoformat()
    if isinstance(value, (date, time)):  # a naive datetime is a date too
        return value.isoformat()
    return repr(value)


def call_key(template: KeyTemplate, task: str, args: Any, kwargs: Any) -> str:
    """The lock name of a call of ``task``: its key ``template`` filled, else ``hashed_key``.

    A task without a ``key`` has a template of ``""``, which only binds the arguments.
    """
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if template.template:
        return template.format(args, kwargs)
    return hashed_key(task, template.arguments(args, kwargs))


# --- the lock service ---------------------------------------------------------------------


def acquire_lease(
    alias: str,
    limit: int | None,
    name: str,
    *,
    ttl: float | None,
    timeout: float | None,
    metadata: dict[str, Any],
    renew: bool,
    template: str,
) -> HeldLock:
    """Acquire ``name`` on backend ``alias``: a mutex, or a slot of a semaphore of ``limit``.

    ``template`` is what metrics label the lease by.
    """
    return locks[alias].acquire(
        name, ttl=ttl, timeout=timeout, metadata=metadata, renew=renew, limit=limit,
        template=template,
    )  # fmt: skip


def adopt_lease(
    ticket: Mapping[str, Any], alias: str, ttl: float | None, template: str
) -> HeldLock:
    """Adopt a queue lease's ``ticket`` on the task's backend ``alias``, labelled ``template``.

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
        return backend.adopt(ticket, ttl=ttl or backend.default_ttl, template=template)
    except (KeyError, TypeError, ValueError, LockConfigurationError) as e:
        raise MalformedTicket(str(e)) from e


class MalformedTicket(ValueError):
    """A ticket that cannot be adopted whatever the lock service says."""


def seconds_until(moment: datetime | str | None, zone: tzinfo | None) -> float:
    """Seconds until ``moment`` (0 if it has passed; None: now), an ISO string or a datetime.

    A naive ``moment`` is read in ``zone``, or in the system's local time
    zone when ``zone`` is None: each adapter says how its framework reads one.
    """
    if moment is None:
        return 0.0
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    if dj_timezone.is_naive(moment):
        moment = moment.astimezone() if zone is None else dj_timezone.make_aware(moment, zone)
    return max((moment - datetime.now(timezone.utc)).total_seconds(), 0.0)


# --- the policy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskPolicy:
    """What one locked task does with its lock; an adapter makes one per task.

    ``task`` is the adapter's task object (sent with ``task_skipped``),
    ``name`` what logs and the holder metadata call it, ``logger`` the
    adapter's, ``key_template`` the key over the arguments callers pass
    (:func:`caller_template`).
    """

    task: Any
    name: str
    options: TaskLockOptions
    logger: logging.Logger
    key_template: KeyTemplate

    def key(self, args: Any, kwargs: Any) -> str:
        """The lock name of a call with ``args`` and ``kwargs``, as callers pass them."""
        return call_key(self.key_template, self.name, args, kwargs)

    @property
    def template(self) -> str:
        """What metrics label this task's locks by: its key template, else ``"<name>:*"``."""
        return self.options.key or f"{self.name}:*"

    def metadata(self, task_id: str | None, worker: str | None, scope: str) -> dict[str, Any]:
        """The holder metadata of a lease this task takes."""
        return {"task_id": task_id, "task_name": self.name, "worker": worker, "scope": scope}

    def lease(
        self,
        key: str,
        *,
        ttl: float | None,
        renew: bool,
        timeout: float | None,
        task_id: str | None,
        worker: str | None,
    ) -> HeldLock:
        """Acquire ``key`` for a run (``renew``) or a message, waiting up to ``timeout``."""
        options = self.options
        scope = "run" if renew else "queue"
        return acquire_lease(
            options.backend,
            options.limit,
            key,
            ttl=ttl,
            timeout=timeout,
            metadata=self.metadata(task_id, worker, scope),
            renew=renew,
            template=self.template,
        )

    def acquire(
        self,
        key: str,
        *,
        ttl: float | None,
        renew: bool,
        task_id: str | None,
        worker: str | None,
        args: Any,
        kwargs: Any,
        refused: Callable[[LockTimeout], HeldLock] | None = None,
    ) -> HeldLock | Skipped:
        """Acquire for a run (``renew``) or a message, else do what ``on_locked`` says.

        ``"raise"`` and ``"wait"`` raise ``LockTimeout``; ``"skip"``
        (:meth:`skipped`) returns :class:`Skipped`; any other value is the
        adapter's: ``refused`` is called with the ``LockTimeout`` and its
        answer returned.
        """
        on_locked = self.options.on_locked
        try:
            return self.lease(
                key,
                ttl=ttl,
                renew=renew,
                timeout=self.options.timeout if on_locked == "wait" else 0,
                task_id=task_id,
                worker=worker,
            )
        except LockTimeout as e:
            if on_locked != "skip":
                if refused is None or on_locked in ("wait", "raise"):
                    raise
                return refused(e)
        return self.skipped(key, task_id, "run" if renew else "queue", args, kwargs)

    def skipped(
        self, key: str, task_id: str | None, scope: str, args: Any, kwargs: Any
    ) -> Skipped:
        """Log a call skipped because ``key`` is held, and send ``task_skipped``."""
        alias = self.options.backend
        holder = skipped_by(alias, key, self.options.limit, self.logger)
        self.logger.info(
            "Skipped %s[%s]: lock %r on %r is held by %r (%s scope).",
            self.name, task_id, key, alias, holder, scope,
        )  # fmt: skip
        task_skipped.send(
            sender=type(self.task), task=self.task, task_id=task_id, name=key, backend=alias,
            scope=scope, args=args, kwargs=kwargs, template=self.template, holder=holder,
        )  # fmt: skip
        return Skipped(key, holder)

    def lost_while_running(self, held: HeldLock, task_id: str | None) -> None:
        """Log a run that ended after its lease was lost (expired or broken by an operator).

        One WARNING for the task, beside the one logged when the loss was
        found. The run's outcome stands as the body left it: failing a task
        whose work is done could make a retry run it again.
        """
        self.logger.warning(
            "%s[%s] ended after its lock %r (token %s) on %r was lost (%s): what it did "
            "from then on was not protected by the lock. Its outcome is kept as the body "
            "left it; check held.ensure() or use fenced writes before effects that must "
            "not overlap.",
            self.name, task_id, held.name, held.token, held.alias, held.lost_reason,
        )  # fmt: skip

    def adopt(self, ticket: Mapping[str, Any], key: str) -> HeldLock | None:
        """The queue lease ``ticket`` hands this call of ``key``; None: acquire as usual.

        None for a ticket naming another key (not this call's lease: one
        passed by hand, maybe copied from another call; releasing it would end
        that call's lease), a malformed one, and a lease that ran out, was
        broken or was adopted already (another delivery of the same message).
        """
        if ticket.get("name") != key:
            self.logger.warning(
                "Ignoring the lock ticket of %s: it names %r, not this call's %r.",
                self.name, ticket.get("name"), key,
            )  # fmt: skip
            return None
        try:
            return adopt_lease(ticket, self.options.backend, self.options.ttl, self.template)
        except LockLost:
            self.logger.info(
                "The queue lease of %s on %r ran out, was broken or was adopted by another "
                "delivery or run; acquiring it as on_locked says.",
                self.name,
                key,
            )
        except MalformedTicket as e:
            self.logger.warning("Ignoring a malformed lock ticket on %s: %s", self.name, e)
        return None

    def release_ticket(self, ticket: Mapping[str, Any]) -> None:
        """Give back the queue lease of ``ticket`` (a message not sent, revoked, rolled back).

        Logged, not raised, when it cannot be: the lease then runs out.
        """
        try:
            locks[ticket["backend"]].release_ticket(ticket)
        except Exception:
            self.logger.warning(
                "Could not release the queue lease %r", ticket.get("name"), exc_info=True
            )


@dataclass(frozen=True)
class Skipped:
    """A call skipped because its ``key`` is held; ``holder`` as :func:`skipped_by` told it."""

    key: str
    holder: dict[str, Any] | None

    @property
    def holder_task_id(self) -> str | None:
        """The id of the task that holds the key, if a task does and says so."""
        task_id = (self.holder or {}).get("task_id")
        return task_id if isinstance(task_id, str) and task_id else None


class PolicyMixin:
    """What both adapters' ``LockedTask`` answer from their :class:`TaskPolicy`.

    A subclass says what its ``policy`` is.
    """

    __slots__ = ()

    @property
    def policy(self) -> TaskPolicy:
        """This task's lock policy."""
        raise NotImplementedError

    def lock_key(self, args: Any = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The lock name for a call with ``args`` and ``kwargs`` (as callers pass them)."""
        return self.policy.key(args, kwargs)

    def lock_pattern(self) -> str:
        """What metrics label this task's locks by: its key template, else ``"<name>:*"``."""
        return self.policy.template


def skipped_by(
    alias: str, key: str, limit: int | None, logger: logging.Logger
) -> dict[str, Any] | None:
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
