"""Errors raised by django-dlock.

There are two trees, for the reason django-anymail gives: a runtime failure is
something the code around a lock handles (wait longer, give up, retry the job),
while a configuration mistake must stop a deploy. Configuration errors subclass
Django's ``ImproperlyConfigured`` so that startup and ``manage.py check`` report
them the Django way, each with a stable check id.

::

    DLockError                      runtime; carries .name and .backend (alias)
    ├── LockTimeout                 not acquired within ``timeout``
    │   └── LockInTransaction       SQLite: a lock inside your atomic() cannot wait
    ├── LockLost                    the lease is gone: expired, broken, or renewal failed
    │   └── LockNotOwned            release/extend by a handle whose lease is not current
    ├── BackendUnavailable          the lock service could not be reached; .transient
    ├── LimitMismatch               a semaphore held with another ``limit`` (also ValueError)
    └── StaleWrite                  a fenced write carried an older fencing token

    django.core.exceptions.ImproperlyConfigured
    └── LockConfigurationError      carries .alias and .check_id (E001, E002, E006-E008)
        ├── InvalidBackendError     BACKEND missing or not importable      django_dlock.E003
        ├── InvalidLockOption       unknown settings or OPTIONS key         django_dlock.E004
        └── InvalidTTL              TTL is not a positive number            django_dlock.E005

``acquire()`` rides out a ``BackendUnavailable`` whose ``transient`` is True (a
server restarting, a connection lost): it retries with backoff until its
timeout, and raises the last one only then. ``transient`` is False for what no
retry fixes (authentication or permission refused, the lock table missing):
that is raised at once. ``timeout=0`` does not retry at all.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured

__all__ = [
    "BackendUnavailable",
    "DLockError",
    "InvalidBackendError",
    "InvalidLockOption",
    "InvalidTTL",
    "LimitMismatch",
    "LockConfigurationError",
    "LockInTransaction",
    "LockLost",
    "LockNotOwned",
    "LockTimeout",
    "StaleWrite",
]


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """An error of ``cls`` unpickled: its message and attributes, ``__init__`` not called."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class _Picklable:
    """Pickled with its attributes, whatever its ``__init__`` takes.

    A Celery task's error reaches its caller through the result backend. With
    the ``pickle`` result serializer it comes back whole (class, message and
    attributes: this). With ``json`` (Celery's default) Celery rebuilds it as
    ``cls(*args)``: the class and the message, every keyword at its default
    (``name``, ``backend``, ``limit`` and ``held_limit`` None, ``transient``
    True). So no error of the package requires a keyword argument.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        error: Any = self
        return (_rebuilt, (type(self), error.args, dict(error.__dict__)))


class DLockError(_Picklable, Exception):
    """Root of every runtime error raised by django-dlock."""

    def __init__(
        self, message: str, *, name: str | None = None, backend: str | None = None
    ) -> None:
        super().__init__(message)
        self.name = name
        self.backend = backend


class LockTimeout(DLockError):
    """The lock was not acquired before the timeout ran out (``timeout=0``: on the one try)."""


class LockLost(DLockError):
    """The lease is gone: it expired, was broken, or the watchdog could not renew it.

    Whatever the holder does next is no longer protected by the lock. Writes
    that must not be repeated should carry the fencing token so that the
    storage can refuse them (see ``StaleWrite``).
    """


class LockNotOwned(LockLost):
    """Release or extend was refused: the caller's owner token is not the current one."""


class BackendUnavailable(DLockError):
    """The lock service could not be reached or answered with an error.

    ``transient`` says whether trying again later may succeed: False when the
    service refused who we are or what we may do (a wrong password, a missing
    permission, no lock table), which only a change of settings fixes.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str | None = None,
        backend: str | None = None,
        transient: bool = True,
    ) -> None:
        super().__init__(message, name=name, backend=backend)
        self.transient = transient


class LimitMismatch(DLockError, ValueError):
    """A semaphore was asked for with a ``limit`` other than the one its holders use.

    ``held_limit`` is the limit of the live holders (or waiters), ``limit`` the
    one asked for. A read/write lock and a semaphore of the same name also
    collide here. Release every holder (or wait for their leases to end)
    before changing a semaphore's limit.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str | None = None,
        backend: str | None = None,
        limit: int | None = None,
        held_limit: int | None = None,
    ) -> None:
        super().__init__(message, name=name, backend=backend)
        self.limit = limit
        self.held_limit = held_limit


class LockInTransaction(LockTimeout):
    """Not acquired: a lock taken inside the caller's transaction cannot wait.

    The database backend on SQLite, inside ``transaction.atomic()`` on the
    same database, when the lock is held or another writer has the database.
    SQLite has one writer at a time: the attempt has taken the write lock for
    the caller's transaction (the holder could not release while we waited),
    or the other writer may be waiting for the caller's transaction to end (a
    deadlock). Raised at once, whatever the timeout, as a ``LockTimeout``.
    Take the lock before ``atomic()`` to wait for it.
    """

    #: The attempt was refused by the service: it took no effect.
    outcome_known = True


class StaleWrite(DLockError):
    """A fenced write was refused because a newer fencing token has already written."""


class LockConfigurationError(_Picklable, ImproperlyConfigured):
    """Root of configuration errors; ``check_id`` is the system check that reports it."""

    check_id = "django_dlock.E006"

    def __init__(
        self, message: str, *, alias: str | None = None, check_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.alias = alias
        if check_id is not None:
            self.check_id = check_id


class InvalidBackendError(LockConfigurationError):
    """``BACKEND`` is missing, or its dotted path cannot be imported."""

    check_id = "django_dlock.E003"


class InvalidLockOption(LockConfigurationError):
    """A settings key or ``OPTIONS`` key that the backend does not know."""

    check_id = "django_dlock.E004"


class InvalidTTL(LockConfigurationError):
    """``TTL`` is not a positive number of seconds."""

    check_id = "django_dlock.E005"
