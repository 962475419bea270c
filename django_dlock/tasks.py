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

The queue-scope lifecycle, walked through in time:

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
"""

from __future__ import annotations

from typing import Any

__all__ = ["TICKET_KWARG", "LockOptions", "LockedTask", "current_lock", "locked_task"]

#: Why the framework could not be imported, if it could not.
_missing: ImportError | None = None
try:
    import django.tasks  # noqa: F401  (Django 6.0 and later)
except ImportError:
    try:
        import django_tasks  # noqa: F401  (the django-tasks package, Django 4.2-5.2)
    except ImportError as e:
        _missing = e

if _missing is None:
    from .task_framework import TICKET_KWARG, LockedTask, LockOptions, current_lock, locked_task
else:
    # Importing this module still works without the framework: Celery's
    # autodiscover_tasks() imports the ``tasks`` module of every installed app,
    # django_dlock's too, and an ImportError there would stop the worker.
    def __getattr__(name: str) -> Any:
        if name in __all__:
            raise ImportError(
                "django_dlock.tasks needs Django's task framework: Django 6.0 or later "
                "(django.tasks), or the django-tasks package on Django 4.2-5.2 "
                "(pip install 'django-dlock[tasks]')."
            ) from _missing
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
