"""Celery: ``@locked_task`` stops the same work from running twice.

The only package of django-dlock that imports Celery. ``locked_task`` is
``shared_task(base=LockedTask, lock=...)``; ``@app.task(base=LockedTask,
lock={...})`` works as well. Lock options (``docs/celery.md`` has the table):

``key``
    A template over the task's arguments, ``"sync:{account_id}"``. The
    default is the task name and a hash of all its arguments.
``ttl``
    Lease length; the watchdog renews it while the body runs.
``backend``
    The ``DLOCK_BACKENDS`` alias.
``on_locked``
    What a call does when its lock is held: ``"skip"`` (log, send
    ``task_skipped``; a worker stores the message as ``REVOKED``, an eager
    or direct call returns None), ``"retry"`` (``self.retry()``),
    ``"raise"`` (``LockTimeout``), ``"wait"`` (up to ``timeout`` seconds) or
    ``"defer"``: park the call in the lock service and re-enqueue it when a
    run of the same key ends (see "Deferred calls" below).
``limit``
    Run at most ``limit`` bodies per key at once (a semaphore) instead of one.
``scope``
    ``"run"``: the lock is held while the body runs. ``"queue"``: it is taken
    in ``apply_async``, so a duplicate is not even enqueued, travels with the
    message as a ticket (``HeldLock.detach()``), and is adopted by the worker
    that runs it and released when the run ends.

The lifecycle, walked through in time, with the cases the peers get wrong::

    t0  apply_async (queue scope) takes "sync:7" for ttl + countdown seconds,
        detaches it and sends the ticket in the message headers. If sending
        fails, the lease is released before the error propagates.
    t1  A worker picks the message up and adopts the lease; the watchdog
        renews it while the body runs. ``self.lock.token`` is its fencing
        token. (Run scope acquires here instead.)
    t2  The body calls ``self.retry()``. Run scope releases first, so that
        the retry, which may start on another worker before this run has
        returned, does not find its own lock. Queue scope hands the lease on
        to the retry's message instead, so no duplicate slips in between.
    t3  The body returns, raises, or raises Ignore/Reject: the lease is
        released in ``__call__`` (``after_return`` is not called for
        Ignore and Reject). The release compares the owner on the server.
    --  A message revoked before it ran releases its queue lease in the
        worker that discards it. A terminated or killed worker renews
        nothing, so its lease runs out within the TTL.

Deferred calls (``on_locked="defer"``): see :mod:`django_dlock.celery.parking`,
whose :func:`park` and :func:`unpark` are the parking queue's public face.
The lock policy itself (keys, ``on_locked``, tickets) is
:mod:`django_dlock.task_policy`, shared with the task framework's adapter.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

from celery import Task, current_app, shared_task
from celery.exceptions import Ignore
from celery.signals import task_revoked, worker_ready, worker_shutdown
from django.core import checks
from kombu.utils.uuid import uuid

from ..clocks import wall_micros
from ..exceptions import LockTimeout
from ..handler import locks
from ..held import HeldLock
from ..keys import KeyTemplate
from ..signals import task_deferred
from ..task_policy import (
    PolicyMixin,
    Skipped,
    TaskLockOptions,
    TaskPolicy,
    caller_template,
    lock_options_given,
    parse_common,
    seconds_until,
)
from .parking import (
    LOOK_AGAIN_AFTER,
    ORDER_HEADER,
    drop_copies,
    header,
    look_for_parked,
    park,
    park_payload,
    parked_key,
    send_parked,
    send_parked_calls,
    stop_looking,
    unpark,
    unpark_key,
)

__all__ = [
    "HEADER",
    "ORDER_HEADER",
    "LockOptions",
    "LockedTask",
    "locked_task",
    "park",
    "send_parked_calls",
    "unpark",
    "unpark_key",
]

logger = logging.getLogger("django_dlock.celery")

#: Message header that carries a queue-scope lease's ticket to the worker.
HEADER = "django_dlock"
ON_LOCKED = ("skip", "retry", "raise", "wait", "defer")

#: Visibility timeouts of the transports that redeliver unacknowledged
#: messages, when ``broker_transport_options`` does not set one (kombu's defaults).
TRANSPORT_VISIBILITY_TIMEOUTS = {
    "redis": 3600.0,
    "rediss": 3600.0,
    "sentinel": 3600.0,
    "sqs": 1800.0,
}

# The lease each running locked task holds in this context (thread, or the
# eager caller's thread), innermost last: (task, task id, handle).
_running: ContextVar[tuple[tuple[Task, str | None, HeldLock], ...]] = ContextVar(
    "django_dlock_celery_running", default=()
)


def leases_here() -> tuple[HeldLock, ...]:
    """The leases of the locked tasks running in this context, innermost first."""
    return tuple(held for _, _, held in reversed(_running.get()))


@dataclass(frozen=True)
class LockOptions(TaskLockOptions):
    """The ``lock={...}`` options of a locked task, validated."""

    countdown: float | None = None

    @classmethod
    def parse(cls, value: Any, task: str = "the task") -> LockOptions:
        """Validate a ``lock={...}`` dict; errors name ``task``."""
        if value is None:
            return cls()
        if isinstance(value, LockOptions):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"lock options of {task} must be a dict, not {type(value).__name__}.")
        common = parse_common(value, task, cls.__dataclass_fields__, ON_LOCKED)
        on_locked, scope = common["on_locked"], common["scope"]
        if on_locked == "retry" and scope == "queue":
            raise ValueError(
                f"on_locked='retry' retries a running task, but in scope='queue' {task} is "
                "refused while it is being enqueued; use 'skip', 'raise' or 'wait'."
            )
        if "countdown" in value and on_locked != "retry":
            raise ValueError(f"countdown applies to on_locked='retry' only ({task}).")
        if scope == "queue" and on_locked == "defer":
            raise ValueError(
                f"on_locked='defer' applies to scope='run' only ({task}): a call refused "
                "while it is being enqueued has no message to park."
            )
        countdown = value.get("countdown")
        if countdown is not None and (
            isinstance(countdown, bool) or not isinstance(countdown, (int, float)) or countdown < 0
        ):
            raise ValueError(f"countdown of {task} must be a number of seconds >= 0.")
        return cls(**common, countdown=None if countdown is None else float(countdown))


class _CurrentLock:
    """``self.lock``: the lease the running task holds here (None when it holds none)."""

    def __get__(self, task: Task | None, cls: type[LockedTask]) -> Any:
        if task is None:
            return self
        for running, _, held in reversed(_running.get()):
            if running is task:
                return held
        return None


class LockedTask(PolicyMixin, Task):  # type: ignore[misc]
    """A Celery task base that runs each distinct call at most once at a time.

    Configure it with ``lock={...}`` (see the module docstring), as a class
    attribute or a task option. While the body runs, ``self.lock`` is its
    :class:`~django_dlock.HeldLock`: ``self.lock.token`` is the fencing token.
    """

    #: The task's ``lock={...}`` options, validated when the class is made.
    lock_options: ClassVar[LockOptions] = LockOptions()
    lock: ClassVar[Any] = _CurrentLock()
    _key_template: ClassVar[KeyTemplate | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "lock" in cls.__dict__:
            # ``lock={...}`` given to the task decorator lands here as a class
            # attribute: keep it as options and let ``self.lock`` be the lease.
            # A subclass that gives none keeps its base's options.
            value = cls.__dict__["lock"]
            delattr(cls, "lock")
            cls.lock_options = LockOptions.parse(value, cls.__dict__.get("name") or cls.__name__)
        cls._key_template = None
        if "run" in cls.__dict__:
            cls._template()  # a key naming no argument fails where the task is defined

    @classmethod
    def _template(cls) -> KeyTemplate:
        template = cls.__dict__.get("_key_template")
        if template is None:
            # ``bind=True`` tasks and ``def run(self, ...)`` are bound; Celery
            # makes the others' ``run`` a staticmethod.
            run = inspect.getattr_static(cls, "run")
            bound = not isinstance(run, staticmethod)
            template = caller_template(cls.lock_options.key, run if bound else run.__func__, bound)
            cls._key_template = template
        return template

    @property
    def policy(self) -> TaskPolicy:
        """This task's lock policy (:mod:`django_dlock.task_policy`)."""
        return TaskPolicy(self, self.name, self.lock_options, logger, self._template())

    # --- running ----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        if request is not None and not request.called_directly:
            # The worker's tracer (or apply()) pushed this run's request already.
            return self._locked_call(request, args, kwargs, self.run)
        return self._locked_call(None, args, kwargs, super().__call__)

    def _locked_call(
        self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any], call: Callable[..., Any]
    ) -> Any:
        key = self.lock_key(args, kwargs)
        task_id = getattr(request, "id", None)
        ticket = _ticket(request)
        held = None if ticket is None else self.policy.adopt(ticket, key)
        if held is None:
            acquired = self._acquire(
                key, self.lock_options.ttl, True, task_id, request, args, kwargs
            )
            if isinstance(acquired, Skipped):
                return self._skip_run(request, acquired)
            held = acquired
        token = _running.set((*_running.get(), (self, task_id, held)))
        try:
            return call(*args, **kwargs)
        finally:
            _running.reset(token)
            # Here rather than in after_return, which Celery skips for Ignore
            # and Reject. A release that finds the lease gone is logged, not
            # raised: the body's work is done, and failing the task now could
            # make autoretry_for run it again.
            if not held.release_quietly() and held.lost_reason is not None:
                self.policy.lost_while_running(held, task_id)
            if self.lock_options.on_locked == "defer":
                if task_id is not None and request is not None:
                    drop_copies(self.lock_options.backend, key, task_id, request)
                send_parked(self.app, self.lock_options.backend, key, 1)

    def _acquire(
        self,
        key: str,
        ttl: float | None,
        renew: bool,
        task_id: str | None,
        request: Any,
        args: Any,
        kwargs: Any,
    ) -> HeldLock | Skipped:
        """Acquire for a run (``renew``) or a message, else do what ``on_locked`` says."""
        options = self.lock_options

        def refused(e: LockTimeout) -> HeldLock:
            if options.on_locked == "retry":  # run scope only: LockOptions refuses it in queue
                raise self.retry(exc=e, countdown=options.countdown) from e
            return self._park(key, task_id, request, args, kwargs)  # "defer"

        return self.policy.acquire(
            key,
            ttl=ttl,
            renew=renew,
            task_id=task_id,
            worker=getattr(request, "hostname", None),
            args=args,
            kwargs=kwargs,
            refused=refused,
        )

    def _skip_run(self, request: Any, skipped: Skipped) -> None:
        """End a run whose key is held: as REVOKED where a worker runs the message.

        A skipped message did not run, so its result must not read as a
        ``SUCCESS`` returning None: it is stored as ``REVOKED`` (``get()``
        raises ``TaskRevokedError`` naming the lock), as Celery stores a
        message it discards, and the run ends with ``Ignore`` so that the
        worker does not overwrite it. A direct or eager call returns None.

        A copy of the message that holds the key, or one of its slots with a
        ``limit`` (redelivered, or sent twice with its id), stores nothing:
        the result is the running one's.
        """
        if request is None or request.called_directly or getattr(request, "is_eager", False):
            return None
        if self._held_by_message(skipped, request.id):
            raise Ignore()
        self.backend.mark_as_revoked(
            request.id,
            f"skipped: lock {skipped.key!r} on {self.lock_options.backend!r} is held",
            request=request,
            store_result=not self.ignore_result or self.store_errors_even_if_ignored,
        )
        raise Ignore()

    def _held_by_message(self, skipped: Skipped, task_id: str) -> bool:
        """Whether the message ``task_id`` holds the skipped key: its mutex, or a slot of it.

        A semaphore's holders are looked up here (the skip's log names none).
        A lookup that fails says no: the skip is then stored.
        """
        if skipped.holder_task_id == task_id:
            return True
        options = self.lock_options
        if options.limit is None:
            return False
        try:
            info = locks[options.backend].semaphore(skipped.key)
        except Exception:
            logger.debug("Could not look up the slots of %r", skipped.key, exc_info=True)
            return False
        return info is not None and any(
            lease.holder.get("task_id") == task_id for lease in info.holders
        )

    def _park(
        self, key: str, task_id: str | None, request: Any, args: Any, kwargs: Any
    ) -> HeldLock:
        """Park this call on ``key`` and end the run; or run now if a slot freed meanwhile."""
        options = self.lock_options
        if task_id is None or request is None or getattr(request, "is_eager", False):
            raise LockTimeout(
                f"{self.name} cannot be deferred here: on_locked='defer' parks a message "
                "for a worker to send again, and this call has none (called directly or "
                "eagerly).",
                name=key,
                backend=options.backend,
            )
        order = header(request, ORDER_HEADER)
        if not isinstance(order, int) or isinstance(order, bool):
            order = wall_micros()
        delivery = getattr(request, "delivery_info", None) or {}
        payload = park_payload(self.name, args, kwargs, delivery, order, options.limit, request)
        parked = parked_key(task_id, request)
        park(options.backend, key, parked, order, payload)
        logger.info("Deferred %s[%s]: no free slot on %r.", self.name, task_id, key)
        # A run that ended before the parking landed popped nobody: take its slot.
        try:
            held = self.policy.lease(
                key,
                ttl=options.ttl,
                renew=True,
                timeout=0,
                task_id=task_id,
                worker=getattr(request, "hostname", None),
            )
        except LockTimeout:
            task_deferred.send(
                type(self), task=self, task_id=task_id, name=key, backend=options.backend,
                args=args, kwargs=kwargs, template=self.lock_pattern(),
            )  # fmt: skip
            # If the holder dies, no run ending pops this call: look for it.
            look_for_parked(self.app, LOOK_AGAIN_AFTER)
            raise Ignore() from None
        if unpark_key(options.backend, key, parked):
            return held
        # Popped and sent again meanwhile: that message runs it, not this one.
        held.release_quietly()
        send_parked(self.app, options.backend, key, 1)
        raise Ignore()

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry()``; in run scope the lease is released before the retry is sent.

        Otherwise the retry could start on another worker before this run has
        returned, find the lock held by its own earlier attempt and be skipped.
        In queue scope the lease travels with the retry's message instead.
        """
        held = self.lock
        if held is not None and self.lock_options.scope == "run":
            held.release_quietly()
        return super().retry(*args, **kwargs)

    # --- enqueueing -------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        *rest: Any,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``; in queue scope, take the lock first.

        A call whose key is held is not sent: ``on_locked="skip"`` returns the
        ``AsyncResult`` of the task that holds the key (as celery-singleton
        does), or None when the holder is not a task or cannot be told.
        """
        lock_options = self.lock_options
        if lock_options.scope != "queue":
            return super().apply_async(args, kwargs, task_id, *rest, **options)
        key = self.lock_key(args, kwargs)
        task_id = task_id or uuid()
        backend = locks[lock_options.backend]
        # The lease covers the wait in the queue; a countdown or eta adds to it.
        ttl = (lock_options.ttl or backend.default_ttl) + _delay(options, self.app)
        held = self._running_lease(task_id, key)
        if held is not None:
            held.extend(ttl)  # a retry of the running task: its lease goes with it
        else:
            # Not renewed: if the message is lost, the lease must run out.
            acquired = self._acquire(key, ttl, False, task_id, None, args, kwargs)
            if isinstance(acquired, Skipped):
                holder = acquired.holder_task_id
                return None if holder is None else self.AsyncResult(holder)
            held = acquired
        ticket = held.detach()
        headers = {**(options.pop("headers", None) or {}), HEADER: ticket}
        try:
            return super().apply_async(args, kwargs, task_id, *rest, headers=headers, **options)
        except BaseException:
            self.policy.release_ticket(ticket)
            raise

    def _running_lease(self, task_id: str, key: str) -> HeldLock | None:
        for running, running_id, held in reversed(_running.get()):
            if running is self and running_id == task_id and held.name == key:
                return held  # type: ignore[no-any-return]
        return None


def locked_task(*args: Any, **options: Any) -> Any:
    """``shared_task`` with ``base=LockedTask``: every Celery option passes through.

    Lock options are keywords (``key``, ``ttl``, ``backend``, ``on_locked``,
    ``scope``, ``timeout``, ``countdown``, ``limit``) or a ``lock={...}`` dict. ``backend``
    is the lock backend alias; Celery's per-task result backend, which shares
    the name, is passed as ``result_backend=``. Works bare (``@locked_task``).
    """
    lock = lock_options_given(options, LockOptions.__dataclass_fields__)
    if "result_backend" in options:
        options["backend"] = options.pop("result_backend")
    base = options.setdefault("base", LockedTask)
    if not (isinstance(base, type) and issubclass(base, LockedTask)):
        raise TypeError(f"base of a locked task must subclass LockedTask, not {base!r}.")

    def create(fun: Callable[..., Any]) -> Any:
        task = options.get("name") or f"{fun.__module__}.{fun.__qualname__}"
        parsed = LockOptions.parse(lock, task)
        # Fail where the task is defined, not when the app is finalized.
        caller_template(parsed.key, fun, bool(options.get("bind")))
        return shared_task(lock=parsed, **options)(fun)

    if len(args) == 1 and callable(args[0]):
        return create(args[0])
    if args:
        raise TypeError("locked_task takes keyword options only: @locked_task(key=...).")
    return create


def _ticket(request: Any) -> Mapping[str, Any] | None:
    """The queue lease's ticket in a request: a header of the message, or eager apply()'s."""
    if request is None:
        return None
    value = getattr(request, HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(HEADER)
    return value if isinstance(value, Mapping) else None


@worker_ready.connect  # type: ignore[untyped-decorator]
def _send_parked_on_start(sender: Any = None, **kwargs: Any) -> None:
    """Send parked calls whose slots are free, and go on looking while the worker runs."""
    look_for_parked(getattr(sender, "app", None) or current_app, keep=True)


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _stop_looking_on_shutdown(**kwargs: Any) -> None:
    stop_looking()


def _delay(options: Mapping[str, Any], app: Any) -> float:
    """Seconds until a message sent with these options may run (countdown or eta).

    A naive ``eta`` is read as Celery's worker reads it: in the system's
    local time zone (Django sets it to ``TIME_ZONE``) when the app's
    ``timezone`` is UTC, else in the app's ``timezone``. Not as UTC: in New York that made the
    lease hours too short, in Tokyo hours too long.
    """
    countdown = options.get("countdown")
    if countdown is not None:
        return max(float(countdown), 0.0)
    return seconds_until(options.get("eta"), None if app.uses_utc_timezone() else app.timezone)


@task_revoked.connect  # type: ignore[untyped-decorator]
def _release_revoked(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """A message revoked before it ran gives its queue lease back at once.

    A terminated run is not released here: its process may still be running
    the body until the signal lands. Its lease runs out within the TTL.
    """
    if not isinstance(sender, LockedTask) or kwargs.get("terminated"):
        return
    ticket = _ticket(request)
    # Only a ticket of the task's own backend: one naming another is not its lease.
    if ticket is not None and ticket.get("backend") == sender.lock_options.backend:
        sender.policy.release_ticket(ticket)


def locked_tasks() -> Iterator[tuple[str, LockOptions]]:
    """The locked tasks of the current Celery app and their options, by name.

    Imports the app's task modules first, as a worker does when it starts:
    in ``manage.py check`` nothing else would, and a project's tasks are in
    the modules Celery imports then: each installed app's ``tasks`` module
    (what ``app.autodiscover_tasks()`` finds, forced here) and the
    ``imports``/``include`` settings. Not the whole worker start-up
    (``import_default_modules()``), which sets Django up once more. None
    while the app cannot be finalized yet (``autofinalize=False``).
    """
    app = current_app
    try:
        app.autodiscover_tasks(force=True)
        for module in app.loader.default_modules:
            app.loader.import_task_module(module)
        tasks = dict(app.tasks)
    except RuntimeError:
        return
    for name, task in sorted(tasks.items()):
        if isinstance(task, LockedTask):
            yield name, task.lock_options


def check_visibility_timeout(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """django_dlock.W002: a locked task whose lease may run out before its message is redelivered.

    A broker with a visibility timeout (Redis, SQS) delivers an unacknowledged
    message again after that long. If the lock has expired by then, a
    duplicate can be enqueued and both run. Checked for every locked task when
    ``broker_transport_options`` sets ``visibility_timeout``, and for
    queue-scope tasks also against the transport's default.
    """
    app = current_app
    options = app.conf.broker_transport_options or {}
    explicit = options.get("visibility_timeout")
    scheme = str(app.conf.broker_url or "").split("://", 1)[0].split("+", 1)[0]
    visibility = (
        float(explicit) if explicit is not None else TRANSPORT_VISIBILITY_TIMEOUTS.get(scheme)
    )
    if visibility is None:
        return []
    messages: list[checks.CheckMessage] = []
    for name, lock_options in locked_tasks():
        if explicit is None and lock_options.scope != "queue":
            continue
        ttl = lock_options.ttl
        if ttl is None:
            try:
                ttl = locks[lock_options.backend].default_ttl
            except Exception:
                continue  # a broken DLOCK_BACKENDS is reported by its own check
        if ttl < visibility:
            messages.append(
                checks.Warning(
                    f"The lock of task {name!r} lasts {ttl:g}s, less than the broker's "
                    f"visibility_timeout of {visibility:g}s: a message redelivered "
                    "after the lock ran out can run the task a second time.",
                    hint="Give the task a lock ttl of at least the visibility_timeout.",
                    obj=name,
                    id="django_dlock.W002",
                )
            )
    return messages
