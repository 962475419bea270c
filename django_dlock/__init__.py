"""Correct distributed locks for Django and Celery.

The public API::

    from django_dlock import lock, locks, LockTimeout, LockLost, DLockError

    with lock("report:daily", ttl=30, timeout=10) as held:
        held.token      # fencing token, strictly increasing per name
        held.ensure()   # raises LockLost if the lease is gone

The documentation (its Guarantees page) says what each backend guarantees.
"""

from .backends.base import LockInfo, SemaphoreInfo, ServerStatus
from .exceptions import (
    BackendUnavailable,
    DLockError,
    LimitMismatch,
    LockInTransaction,
    LockLost,
    LockNotOwned,
    LockTimeout,
    StaleWrite,
)
from .handler import locks
from .held import HeldLock
from .lock import Lock, lock
from .semaphores import RWLock, Semaphore, rwlock, semaphore

__all__ = [
    "BackendUnavailable",
    "DLockError",
    "HeldLock",
    "LimitMismatch",
    "Lock",
    "LockInTransaction",
    "LockInfo",
    "LockLost",
    "LockNotOwned",
    "LockTimeout",
    "RWLock",
    "Semaphore",
    "SemaphoreInfo",
    "ServerStatus",
    "StaleWrite",
    "lock",
    "locks",
    "rwlock",
    "semaphore",
]
