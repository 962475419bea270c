"""Django's task framework: ``@locked_task`` stops the same work from running twice.

The only module of django-dlock that imports the task framework: Django's own
``django.tasks`` (Django 6.0 and later) or, on Django 4.2-5.2, the
``django-tasks`` package (``django_tasks``), which has the same API. The task
it makes is a :class:`LockedTask`, a subclass of the framework's ``Task``, so
``enqueue()``, ``using()``, ``get_result()`` and every backend work as usual.
Lock options (``docs/django-tasks.md`` has the table):

``key``
    A template over the task's arguments, ``"sync:{account_id}"``. The
    default is the task's module path and a hash of all its arguments.
``ttl``
    Lease length; the watchdog renews it while the body runs.
``backend``
    The ``DLOCK_BACKENDS`` alias. The *task* backend (``TASKS`` alias), which
    shares the name in ``@task``, is passed as ``task_backend=``.
``on_locked``
    What a call does when its lock is held: ``"skip"`` (log, send
    ``task_skipped``, return None), ``"raise"`` (``LockTimeout``) or
    ``"wait"`` (up to ``timeout`` seconds). Celery's ``"retry"`` and
    ``"defer"`` are refused where the task is defined: the task framework
    has no retry, and deferred calls are parked and sent again through
    Celery.
``limit``
    Run at most ``limit`` bodies per key at once (a semaphore) instead of one.
``scope``
    ``"run"``: the lock is held while the body runs. ``"queue"``: it is taken
    in ``enqueue()``, so a duplicate is not even enqueued (``enqueue()``
    returns None), travels with the task as a ticket (``HeldLock.detach()``)
    in its keyword arguments, and is adopted by the worker that runs it and
    released when the run ends.

The queue-scope lifecycle, walked through in time::

    t0  enqueue() takes "sync:7" for ttl seconds (plus the wait until
        ``run_after``), not renewed, detaches it and enqueues the call with
        the ticket as the keyword argument ``TICKET_KWARG``. If enqueueing
        fails, the lease is released before the error propagates.
    t1  A worker runs the call: the ticket is taken out of the keyword
        arguments, and the lease adopted and renewed while the body runs.
        ``current_lock().token`` is its fencing token.
    t2  The body returns or raises: the lease is released.
    --  A call that never runs (its worker is down, the result row deleted)
        renews nothing, so its lease runs out after ttl: then a duplicate
        may be enqueued. A call that runs after its lease ran out (or was
        broken) acquires the lock as ``on_locked`` says instead.

The lock policy itself (keys, ``on_locked``, tickets, the skip signal) is
:mod:`django_dlock.task_policy`, shared with the Celery adapter. Importing
this module without the framework raises an ``ImportError`` that says what
to install.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone as dj_timezone

from .handler import locks
from .held import HeldLock
from .keys import KeyTemplate
from .task_policy import (
    PolicyMixin,
    Skipped,
    TaskLockOptions,
    TaskPolicy,
    caller_template,
    lock_options_given,
    parse_common,
    seconds_until,
)
from .transactions import on_rollback

try:
    try:
        from django.tasks import task_backends
    except ImportError:  # Django before 6: the django-tasks package
        from django_tasks import task_backends  # type: ignore[no-redef,assignment,unused-ignore]
except ImportError as e:
    raise ImportError(
        "django_dlock.task_framework needs Django's task framework: Django 6.0 or later "
        "(django.tasks), or the django-tasks package on Django 4.2-5.2 "
        "(pip install 'django-dlock[tasks]')."
    ) from e

try:
    from django.tasks.base import (
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_PRIORITY,
        DEFAULT_TASK_QUEUE_NAME,
        Task,
        TaskResult,
    )
    from django.tasks.signals import task_finished, task_started
    from django.utils.json import normalize_json
except ImportError:  # Django before 6: the django-tasks package
    from django_tasks.base import (  # type: ignore[no-redef,assignment,unused-ignore]
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_PRIORITY,
        DEFAULT_TASK_QUEUE_NAME,
        Task,
        TaskResult,
    )
    from django_tasks.signals import (  # type: ignore[no-redef,assignment,unused-ignore]
        task_finished,
        task_started,
    )
    from django_tasks.utils import normalize_json  # type: ignore[no-redef,unused-ignore]

__all__ = ["TICKET_KWARG", "LockOptions", "LockedTask", "current_lock", "locked_task"]

logger = logging.getLogger("django_dlock.task_framework")

#: The keyword argument that carries a queue-scope lease's ticket to the worker.
TICKET_KWARG = "django_dlock_ticket"
ON_LOCKED = ("skip", "raise", "wait")
#: Celery's ``on_locked`` values that the task framework cannot honour, and why.
CELERY_ONLY = {
    "retry": "the task framework has no retry",
    "defer": (
        "deferred calls are parked in the lock service and sent again through Celery; "
        "the task framework has no such hook"
    ),
}

# The lease each running locked task holds in this context, innermost last.
_running: ContextVar[tuple[HeldLock, ...]] = ContextVar("django_dlock_tasks_running", default=())
# The result the worker announced (task_started) for the run under way here.
_started: ContextVar[Any] = ContextVar("django_dlock_tasks_started", default=None)


@dataclass(frozen=True)
class LockOptions(TaskLockOptions):
    """The lock options of a locked task, validated."""

    @classmethod
    def parse(cls, value: Mapping[str, Any], task: str = "the task") -> LockOptions:
        """Validate the options given to ``locked_task``; errors name ``task``."""
        on_locked = value.get("on_locked", "skip")
        if on_locked in CELERY_ONLY:
            raise ValueError(
                f"on_locked={on_locked!r} of {task} is Celery-only ({CELERY_ONLY[on_locked]}); "
                f"use one of {ON_LOCKED!r}."
            )
        return cls(**parse_common(value, task, cls.__dataclass_fields__, ON_LOCKED))


# The lock options of each task ``locked_task`` made, by name, for the system checks.
_defined: dict[str, LockOptions] = {}


def locked_tasks() -> Iterator[tuple[str, LockOptions]]:
    """The locked tasks defined so far (in modules imported by now) and their options."""
    yield from sorted(_defined.items())


def leases_here() -> tuple[HeldLock, ...]:
    """The leases of the locked tasks running in this context, innermost first."""
    return tuple(reversed(_running.get()))


def current_lock() -> HeldLock | None:
    """The lease of the locked task whose body runs here (innermost), else None.

    ``current_lock().token`` is the run's fencing token.
    """
    running = _running.get()
    return running[-1] if running else None


@dataclass(frozen=True, slots=True, kw_only=True)
class LockedTask(Task, PolicyMixin):  # type: ignore[type-arg,unused-ignore]
    """A task that runs each distinct call at most once at a time (see the module docstring).

    ``lock_options`` and ``key_template`` are dataclass fields, so ``using()``
    keeps them.
    """

    lock_options: LockOptions = field(default_factory=LockOptions)
    key_template: KeyTemplate | None = field(default=None, compare=False, repr=False)

    def _template(self) -> KeyTemplate:
        if self.key_template is not None:
            return self.key_template
        return caller_template(self.lock_options.key, self.func, self.takes_context)

    @property
    def policy(self) -> TaskPolicy:
        """This task's lock policy (:mod:`django_dlock.task_policy`)."""
        return TaskPolicy(self, self.module_path, self.lock_options, logger, self._template())

    # --- running ----------------------------------------------------------------------

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the lock; what workers (and ImmediateBackend) call."""
        held = self._enter(args, kwargs)
        if held is None:
            return None
        token = _running.set((*_running.get(), held))
        try:
            return Task.call(self, *args, **kwargs)
        finally:
            _running.reset(token)
            if not held.release_quietly() and held.lost_reason is not None:
                self.policy.lost_while_running(held, self._task_id(args))

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`call`, awaited.

        The lock is taken in a thread of the lock backend's ``waits``
        executor (a wait must not hold the one thread that sync code called
        from async shares, nor a thread of the loop's default executor that a
        release may need), then the body runs as the framework's ``acall``
        runs it. Cancelled while it waits, the lease the thread gets after all
        is released.
        """
        backend = locks[self.lock_options.backend]
        future = backend.offload.submit("waits", self._enter, args, kwargs)
        try:
            held = await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            # The thread goes on and may get the lease: nobody would run under
            # it, so it is released as soon as it comes, in that thread (the
            # event loop may be closed by then).
            future.add_done_callback(_release_unwanted)
            raise
        if held is None:
            return None
        token = _running.set((*_running.get(), held))
        try:
            return await Task.acall(self, *args, **kwargs)
        finally:
            _running.reset(token)
            if not await held.arelease_quietly() and held.lost_reason is not None:
                self.policy.lost_while_running(held, self._task_id(args))

    def _enter(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HeldLock | None:
        """The run's lease: the queue lease its ticket hands over, or a new one (None: skip).

        Takes the ticket out of ``kwargs``. Only a queue-scope task adopts
        one: ``enqueue()`` refuses the keyword, so a run-scope call that has
        it was not made by us, and its ticket is left to run out.
        """
        ticket = kwargs.pop(TICKET_KWARG, None)
        call_args = args[1:] if self.takes_context else args
        key = self.lock_key(call_args, kwargs)
        held = None
        if isinstance(ticket, Mapping) and self.lock_options.scope == "queue":
            held = self.policy.adopt(ticket, key)
        elif ticket is not None:
            logger.warning("Ignoring a lock ticket given to %s (run scope).", self.module_path)
        if held is None:
            acquired = self._acquire(
                key, self.lock_options.ttl, True, self._task_id(args), call_args, kwargs
            )
            held = None if isinstance(acquired, Skipped) else acquired
        return held

    def _task_id(self, args: tuple[Any, ...]) -> str | None:
        if self.takes_context and args:
            result = getattr(args[0], "task_result", None)
        else:
            result = _started.get()
        task = getattr(result, "task", None)
        if task is None or getattr(task, "func", None) is not self.func:
            return None
        return getattr(result, "id", None)

    def _acquire(
        self, key: str, ttl: float | None, renew: bool, task_id: str | None, args: Any, kwargs: Any
    ) -> HeldLock | Skipped:
        """Acquire for a run (``renew``) or an enqueue, else do what ``on_locked`` says."""
        return self.policy.acquire(
            key,
            ttl=ttl,
            renew=renew,
            task_id=task_id,
            worker=_worker_id(task_id),
            args=args,
            kwargs=kwargs,
        )

    # --- enqueueing -------------------------------------------------------------------

    def enqueue(self, *args: Any, **kwargs: Any) -> Any:
        """The framework's ``enqueue()``; in queue scope, take the lock first.

        A call whose key is held is not enqueued: ``on_locked="skip"`` returns
        None. (Not the holder's ``TaskResult``, as Celery's adapter returns
        the holder's ``AsyncResult``: the lease is taken before the framework
        gives the task its id, so the holder metadata has none.)
        """
        if TICKET_KWARG in kwargs:
            raise TypeError(f"{TICKET_KWARG!r} is reserved for the lock's ticket.")
        if self.lock_options.scope != "queue":
            return Task.enqueue(self, *args, **kwargs)
        # The key of the arguments as the worker will get them (JSON: a tuple
        # arrives as a list), so that the run finds its ticket's name.
        key = self.lock_key(
            normalize_json(list(args)), cast(dict[str, Any], normalize_json(kwargs))
        )
        backend = locks[self.lock_options.backend]
        # The lease covers the wait in the queue, and the wait until run_after.
        ttl = (self.lock_options.ttl or backend.default_ttl) + _delay(self.run_after)
        # Not renewed: if the call never runs, the lease must run out.
        acquired = self._acquire(key, ttl, False, None, args, kwargs)
        if isinstance(acquired, Skipped):
            return None
        ticket = acquired.detach()
        try:
            result = Task.enqueue(self, *args, **kwargs, **{TICKET_KWARG: ticket})
        except BaseException:
            self.policy.release_ticket(ticket)
            raise
        # Enqueued inside atomic(): a task backend that stores tasks in the
        # database (django-tasks-db) loses the task if it rolls back, and the
        # lease must go with it, or every retry is skipped until it runs out.
        _release_on_rollback(self.policy, ticket)
        return result

    async def aenqueue(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`enqueue`, awaited."""
        if TICKET_KWARG in kwargs:
            raise TypeError(f"{TICKET_KWARG!r} is reserved for the lock's ticket.")
        if self.lock_options.scope != "queue":
            return await Task.aenqueue(self, *args, **kwargs)
        return await sync_to_async(self.enqueue)(*args, **kwargs)


def locked_task(function: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """The framework's ``@task`` making a :class:`LockedTask`; its options pass through.

    Lock options are keywords (``key``, ``ttl``, ``backend``, ``on_locked``,
    ``scope``, ``timeout``, ``limit``) or a ``lock={...}`` dict. ``backend``
    is the lock backend alias; the task backend (``TASKS`` alias), which
    shares the name in ``@task``, is passed as ``task_backend=``. ``priority``, ``queue_name`` and
    ``takes_context`` pass through. Works bare (``@locked_task``).
    """
    lock = lock_options_given(options, LockOptions.__dataclass_fields__)
    task_backend = options.pop("task_backend", DEFAULT_TASK_BACKEND_ALIAS)
    passed = {"priority", "queue_name", "takes_context"}
    unknown = sorted(set(options) - passed)
    if unknown:
        raise TypeError(
            f"Unknown options {unknown!r} for locked_task; lock options are "
            f"{sorted(LockOptions.__dataclass_fields__)!r}, task options "
            f"{sorted({*passed, 'task_backend'})!r}."
        )

    def create(func: Callable[..., Any]) -> LockedTask:
        name = f"{func.__module__}.{func.__qualname__}"
        parsed = LockOptions.parse(lock, name)
        takes_context = bool(options.get("takes_context", False))
        # Fail where the task is defined, not when it first runs.
        template = caller_template(parsed.key, func, takes_context)
        task_class = task_backends[task_backend].task_class
        if not issubclass(LockedTask, task_class):
            raise TypeError(
                f"locked_task cannot lock {name}: task backend {task_backend!r} makes "
                f"{task_class.__qualname__} tasks, and a LockedTask is a plain Task."
            )
        task_options: dict[str, Any] = {
            "priority": DEFAULT_TASK_PRIORITY,
            "queue_name": DEFAULT_TASK_QUEUE_NAME,
            **options,
        }
        task = LockedTask(
            func=func,
            backend=task_backend,
            run_after=None,
            lock_options=parsed,
            key_template=template,
            **task_options,
        )
        _defined[name] = parsed
        return task

    if function is not None:
        if not callable(function):
            raise TypeError("locked_task takes keyword options only: @locked_task(key=...).")
        return create(function)
    return create


def _release_unwanted(entering: concurrent.futures.Future[HeldLock | None]) -> None:
    """Release what a cancelled ``acall()``'s thread got, in that thread."""
    if entering.cancelled() or entering.exception() is not None:
        return
    held = entering.result()
    if held is not None:
        held.release_quietly()


def _release_on_rollback(policy: TaskPolicy, ticket: Mapping[str, Any]) -> None:
    """Release the queue lease of ``ticket`` if an open transaction rolls back.

    Also if an ``on_commit`` hook registered before this one raises: Django
    then drops the hooks after it, which cannot be told from a rollback.

    Every database connection inside ``atomic()`` counts: the task backend's
    own database is not known here. A rollback on another one releases the
    lease of a task that was enqueued; its run then takes the lock afresh
    (the ticket no longer adopts), so no two runs overlap, though a
    duplicate may be enqueued meanwhile.
    """
    backend = locks[ticket["backend"]]
    for connection in connections.all(initialized_only=True):
        on_rollback(backend, functools.partial(policy.release_ticket, ticket), connection.alias)


def _delay(run_after: datetime | None) -> float:
    """Seconds until a task with this ``run_after`` may run.

    A naive ``run_after`` is read in the current time zone
    (``django.utils.timezone.get_current_timezone()``: ``TIME_ZONE`` unless
    one is activated), as the task backends read it: with ``USE_TZ=False``
    they store it as is and compare it with the local ``timezone.now()``.
    (With ``USE_TZ=True`` the framework refuses a naive one before this.)
    """
    return seconds_until(run_after, dj_timezone.get_current_timezone())


def _worker_id(task_id: str | None) -> str | None:
    """The id of the worker running ``task_id`` here, if the worker said (``task_started``)."""
    result = _started.get()
    if task_id is None or getattr(result, "id", None) != task_id:
        return None
    workers = getattr(result, "worker_ids", None)
    return str(workers[-1]) if workers else None


def _remember_started(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:  # type: ignore[type-arg,unused-ignore]
    """The worker announces each run before it calls the task: keep its result for task_id."""
    _started.set(task_result)


def _forget_started(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:  # type: ignore[type-arg,unused-ignore]
    _started.set(None)


task_started.connect(_remember_started, dispatch_uid="django_dlock.task_framework.started")
task_finished.connect(_forget_started, dispatch_uid="django_dlock.task_framework.finished")
