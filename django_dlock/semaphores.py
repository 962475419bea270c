"""``semaphore(name, limit=N)`` and ``rwlock(name)``: N holders at most; readers or one writer.

Both are used like :func:`~django_dlock.lock`: a context manager, an async
context manager, a decorator with a templated name, or ``acquire()`` by hand.
Each holder gets a :class:`~django_dlock.HeldLock` of its own: a lease renewed
by the watchdog, a fencing token from the name's counter, ``ensure()``,
``extend()`` and ``release()``.

::

    with semaphore("exports", limit=3, timeout=30) as held:
        held.token
    with rwlock("catalog").read():    # many readers at once
        ...
    with rwlock("catalog").write():   # one writer, no reader
        ...

A writer that waits stops new readers from entering, so a steady stream of
readers cannot starve it. The tokens of one name increase with every grant,
read or write, so a write's token is larger than those of the reads and
writes granted before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import conf
from .backends.limits import RW_LIMIT, validate_limit
from .handler import locks
from .held import HeldLock
from .lock import Lock

__all__ = ["RWLock", "Semaphore", "rwlock", "semaphore"]


class Semaphore(Lock):
    """At most ``limit`` holders of ``name`` at once; otherwise as :class:`~django_dlock.Lock`.

    Every process must use the same ``limit`` for a name: while it has
    holders, asking with another raises :class:`~django_dlock.LimitMismatch`.
    ``release_on_commit`` is not offered.
    """

    def __init__(self, name: str, *, limit: int, **kwargs: Any) -> None:
        if "release_on_commit" in kwargs or "using" in kwargs:
            raise TypeError("semaphores and read/write locks do not take release_on_commit.")
        super().__init__(name, **kwargs)
        self.limit = validate_limit(limit)
        self.weight = 1

    def __repr__(self) -> str:
        return f"<Semaphore {self.name!r} limit={self.limit} backend={self.backend!r}>"

    def _acquire(
        self, timeout: float | None, name: str | None, template: str | None = None
    ) -> HeldLock:
        name, timeout = self._resolve(timeout, name)
        return locks[self.backend].acquire(
            name, ttl=self.ttl, timeout=timeout, metadata=self.metadata, renew=self.renew,
            limit=self.limit, weight=self.weight, template=template,
        )  # fmt: skip

    async def _aacquire(
        self, timeout: float | None, name: str | None, template: str | None = None
    ) -> HeldLock:
        name, timeout = self._resolve(timeout, name)
        return await locks[self.backend].aacquire(
            name, ttl=self.ttl, timeout=timeout, metadata=self.metadata, renew=self.renew,
            limit=self.limit, weight=self.weight, template=template,
        )  # fmt: skip


def semaphore(
    name: str,
    *,
    limit: int,
    ttl: float | None = None,
    timeout: float | None = None,
    backend: str = conf.DEFAULT_ALIAS,
    metadata: Mapping[str, Any] | None = None,
    renew: bool = True,
) -> Semaphore:
    """What to acquire: a :class:`Semaphore` of ``limit`` holders on ``name``.

    Used as :func:`~django_dlock.lock` is (``with``, ``async with``, a
    decorator, ``acquire()``); each holder gets a
    :class:`~django_dlock.HeldLock` of its own. The other arguments are
    :func:`~django_dlock.lock`'s.
    """
    return Semaphore(
        name, limit=limit, ttl=ttl, timeout=timeout, backend=backend, metadata=metadata,
        renew=renew,
    )  # fmt: skip


class _RWSide(Semaphore):
    def __init__(self, name: str, *, write: bool, **kwargs: Any) -> None:
        super().__init__(name, limit=1, **kwargs)
        self.limit = RW_LIMIT
        self.weight = RW_LIMIT if write else 1
        self.mode = "write" if write else "read"

    def __repr__(self) -> str:
        return f"<rwlock {self.name!r} {self.mode} backend={self.backend!r}>"


class RWLock:
    """A read/write lock on ``name``: ``read()`` and ``write()`` give what to acquire.

    The keyword arguments (``ttl``, ``timeout``, ``backend``, ``metadata``,
    ``renew``) are those of :func:`~django_dlock.lock` and apply to both sides.
    A reader cannot become a writer while it holds (that would deadlock with
    another reader doing the same): release, then acquire ``write()``.
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        backend: str = conf.DEFAULT_ALIAS,
        metadata: Mapping[str, Any] | None = None,
        renew: bool = True,
    ) -> None:
        self._kwargs: dict[str, Any] = {
            "ttl": ttl,
            "timeout": timeout,
            "backend": backend,
            "metadata": metadata,
            "renew": renew,
        }
        # Validates the arguments now, as lock() does.
        self._read = _RWSide(name, write=False, **self._kwargs)
        self.name = self._read.name

    def __repr__(self) -> str:
        return f"<RWLock {self.name!r} backend={self._kwargs['backend']!r}>"

    def read(self) -> Semaphore:
        """Shared: many readers at once, no writer."""
        return _RWSide(self.name, write=False, **self._kwargs)

    def write(self) -> Semaphore:
        """Exclusive: one writer, no reader; a waiting writer holds back new readers."""
        return _RWSide(self.name, write=True, **self._kwargs)


def rwlock(
    name: str,
    *,
    ttl: float | None = None,
    timeout: float | None = None,
    backend: str = conf.DEFAULT_ALIAS,
    metadata: Mapping[str, Any] | None = None,
    renew: bool = True,
) -> RWLock:
    """A read/write lock on ``name``: acquire ``.read()`` (shared) or ``.write()`` (exclusive).

    ``with rwlock("catalog").read():`` lets many readers in at once;
    ``with rwlock("catalog").write():`` one writer and no reader. The
    arguments are :func:`~django_dlock.lock`'s and apply to both sides.
    """
    return RWLock(name, ttl=ttl, timeout=timeout, backend=backend, metadata=metadata, renew=renew)
