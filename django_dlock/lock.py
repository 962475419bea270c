"""``lock(...)``: what to acquire, as a context manager, a decorator, or by hand.

``lock(name, ...)`` returns a :class:`Lock`, a reusable description of what to
acquire. Each acquisition yields a :class:`~django_dlock.held.HeldLock`, the
lease actually granted, with its fencing token (see :mod:`django_dlock.held`
for how a lease can be lost while held). ``with lock("x") as held`` keeps the
handle for the block; the decorator acquires per call, so one decorated
function is safe to call from many threads at once.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from . import conf
from ._validation import dump_holder, validate_name, validate_timeout, validate_ttl
from .handler import locks
from .held import HeldLock, arelease_on_exit, release_on_exit
from .keys import KeyTemplate
from .transactions import release_at_transaction_end

__all__ = ["Lock", "lock"]

F = TypeVar("F", bound=Callable[..., Any])


class _LockTimeout:
    """The default of ``acquire(timeout=...)``: the ``timeout`` given to ``lock()``."""

    def __repr__(self) -> str:
        # Signatures (help(), the API reference) show the default by this.
        return "<the lock's timeout>"


_UNSET: Any = _LockTimeout()


# What each Lock acquired in this context (thread or asyncio task), innermost last.
# Weak references: the Lock object keeps its own handles alive, so dropping the
# Lock (and the handle) lets the watchdog stop renewing and the lease expire.
_acquired: ContextVar[tuple[tuple[weakref.ref[Lock], weakref.ref[HeldLock]], ...]] = ContextVar(
    "django_dlock_acquired", default=()
)
#: The leases of ``@lock(...)``-decorated calls running in this thread or task,
#: innermost last: a locked save inside one writes under its lease (saves.py).
decorated: ContextVar[tuple[HeldLock, ...]] = ContextVar("django_dlock_decorated", default=())


class Lock:
    """A distributed lock on ``name``: what to acquire, not an acquisition.

    ``ttl``: lease length in seconds (default: the backend's ``TTL``, 30 s).
    ``timeout``: None waits forever, 0 tries once, otherwise seconds to wait
    before :class:`~django_dlock.LockTimeout`. ``backend``: the alias in
    ``DLOCK_BACKENDS``. ``metadata``: extra JSON-serializable holder details
    shown by ``manage.py locks``. ``renew``: let the watchdog renew the lease.
    ``release_on_commit``: leaving the block inside ``transaction.atomic()``
    keeps the lock until that transaction commits or rolls back, so that
    nobody reads what the block wrote before it is committed. The
    transaction is the one open on ``using``; without ``using``, on the
    database backend's own database, else the only one open in this
    thread. Several open, or none on ``using`` while another is, raises
    :class:`~django_dlock.transactions.AmbiguousTransaction` on leaving.

    Use it as ``with lock(...) as held:``, ``async with``, as a decorator, or
    call :meth:`acquire` by hand. As a decorator, ``name`` may be a template
    over the function's arguments: ``@lock("invoice:{invoice_id}")``.
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
        release_on_commit: bool = False,
        using: str | None = None,
    ) -> None:
        self.name = validate_name(name)
        self.ttl = None if ttl is None else validate_ttl(ttl)
        self.timeout = validate_timeout(timeout)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be an alias (str), not {type(backend).__name__}.")
        self.backend = backend
        if metadata is not None:
            if not isinstance(metadata, Mapping):
                raise TypeError("metadata must be a dict.")
            dump_holder(metadata)
        self.metadata = dict(metadata) if metadata else None
        self.renew = renew
        if not isinstance(release_on_commit, bool):
            raise TypeError(f"release_on_commit must be True or False, not {release_on_commit!r}.")
        if using is not None and not isinstance(using, str):
            raise TypeError(f"using must be a DATABASES alias (str), not {type(using).__name__}.")
        self.release_on_commit = release_on_commit
        self.using = using
        self._handles: set[HeldLock] = set()
        # One Lock may be shared by threads (a module-level lock(...) acquired
        # with name=...): its set of handles is changed under this mutex.
        self._handles_mutex = threading.Lock()

    def __repr__(self) -> str:
        return f"<Lock {self.name!r} backend={self.backend!r}>"

    def acquire(self, timeout: float | None = _UNSET, *, name: str | None = None) -> HeldLock:
        """Acquire and return the handle; ``timeout`` overrides the one given to ``lock()``.

        The handle is also remembered, so :meth:`release` (or leaving a
        ``with`` block) on this object releases the latest acquisition made in
        the current thread or task.
        """
        held = self._acquire(timeout, name)
        self._remember(held)
        return held

    def _remember(self, held: HeldLock) -> None:
        try:
            self._push(held)
        except BaseException:
            held.release_quietly()  # nobody would get the handle to release it
            raise

    def acquire_handle(
        self,
        timeout: float | None = _UNSET,
        *,
        name: str | None = None,
        template: str | None = None,
    ) -> HeldLock:
        """Acquire and return the handle without remembering it on this object.

        For code that keeps the handle itself and releases it with
        ``held.release()``: :meth:`release` on this object will not find it.
        ``name`` replaces the lock's name (a template's result, say), and
        ``template`` is that key template (``HeldLock.template``).
        """
        return self._acquire(timeout, name, template)

    async def aacquire_handle(
        self,
        timeout: float | None = _UNSET,
        *,
        name: str | None = None,
        template: str | None = None,
    ) -> HeldLock:
        """:meth:`acquire_handle`, awaited."""
        return await self._aacquire(timeout, name, template)

    def release(self) -> None:
        """Release the latest acquisition of this object in the current thread or task.

        With ``release_on_commit`` inside ``atomic()``: when the transaction ends.
        """
        held = self._pop()
        if not self._release_at_commit(held):
            held.release()

    async def aacquire(
        self, timeout: float | None = _UNSET, *, name: str | None = None
    ) -> HeldLock:
        """:meth:`acquire`, awaited: the backend's awaitable primitives, no blocking call."""
        held = await self._aacquire(timeout, name)
        self._remember(held)
        return held

    async def arelease(self) -> None:
        """:meth:`release`, awaited."""
        await self._pop().arelease()

    def __enter__(self) -> HeldLock:
        return self.acquire()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        held = self._pop()
        if not self._release_at_commit(held, exc_type is not None):
            release_on_exit(held, exc_type is not None)

    async def __aenter__(self) -> HeldLock:
        return await self.aacquire()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await arelease_on_exit(self._pop(), exc_type is not None)

    def __call__(self, func: F) -> F:
        """Decorate ``func`` so each call runs under the lock, the key built from its arguments."""
        template = KeyTemplate(self.name, inspect.signature(func), func.__qualname__)
        key_for = template.format

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                held = await self._aacquire(_UNSET, key_for(args, kwargs), self.name)
                reset = decorated.set((*decorated.get(), held))
                try:
                    result = await func(*args, **kwargs)
                except BaseException:
                    decorated.reset(reset)
                    await arelease_on_exit(held, True)
                    raise
                decorated.reset(reset)
                await arelease_on_exit(held, False)
                return result

            return cast(F, async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            held = self._acquire(_UNSET, key_for(args, kwargs), self.name)
            reset = decorated.set((*decorated.get(), held))
            try:
                result = func(*args, **kwargs)
            except BaseException:
                decorated.reset(reset)
                if not self._release_at_commit(held, True):
                    release_on_exit(held, True)
                raise
            decorated.reset(reset)
            if not self._release_at_commit(held):
                release_on_exit(held, False)
            return result

        return cast(F, wrapper)

    # --- internals -------------------------------------------------------------------

    def _release_at_commit(self, held: HeldLock, body_raised: bool = False) -> bool:
        """With ``release_on_commit`` inside ``atomic()``: leave the release to its end."""
        if not self.release_on_commit:
            return False
        return release_at_transaction_end(
            held, self.using, body_raised=body_raised, strict=self.using is not None
        )

    def _acquire(
        self, timeout: float | None, name: str | None, template: str | None = None
    ) -> HeldLock:
        """Acquire ``name`` (made from key ``template``, if any) or this lock's own name."""
        name, timeout = self._resolve(timeout, name)
        return locks[self.backend].acquire(
            name, ttl=self.ttl, timeout=timeout, metadata=self.metadata, renew=self.renew,
            template=template,
        )  # fmt: skip

    async def _aacquire(
        self, timeout: float | None, name: str | None, template: str | None = None
    ) -> HeldLock:
        name, timeout = self._resolve(timeout, name)
        return await locks[self.backend].aacquire(
            name, ttl=self.ttl, timeout=timeout, metadata=self.metadata, renew=self.renew,
            template=template,
        )  # fmt: skip

    def _resolve(self, timeout: float | None, name: str | None) -> tuple[str, float | None]:
        return (
            self.name if name is None else name,
            self.timeout if timeout is _UNSET else timeout,
        )

    def _push(self, held: HeldLock) -> None:
        # Handles released or detached directly (``h.release()`` rather than
        # ``lock.release()``) are dropped here, so that a long-lived Lock
        # keeps only what may still be popped; the stack keeps weak references.
        handles = self._handles
        with self._handles_mutex:
            ended = [h for h in handles if h.released or h.detached]
            handles.difference_update(ended)
            handles.add(held)
        live = tuple(
            entry for entry in _acquired.get() if entry[0]() is not None and entry[1]() is not None
        )
        _acquired.set((*live, (weakref.ref(self), weakref.ref(held))))

    def _pop(self) -> HeldLock:
        stack = _acquired.get()
        for i in range(len(stack) - 1, -1, -1):
            held = stack[i][1]()
            if stack[i][0]() is self and held is not None:
                _acquired.set(stack[:i] + stack[i + 1 :])
                with self._handles_mutex:
                    self._handles.discard(held)
                return held
        raise RuntimeError(f"{self!r} was not acquired in this thread or task.")


def leases_here() -> list[HeldLock]:
    """The leases taken in this thread or task by ``with lock(...)``,
    ``lock(...).acquire()`` or a ``@lock(...)``-decorated call, innermost first."""
    stacked = [held for ref, held_ref in _acquired.get() if ref() and (held := held_ref())]
    return [*reversed(stacked), *reversed(decorated.get())]


def lock(
    name: str,
    *,
    ttl: float | None = None,
    timeout: float | None = None,
    backend: str = conf.DEFAULT_ALIAS,
    metadata: Mapping[str, Any] | None = None,
    renew: bool = True,
    release_on_commit: bool = False,
    using: str | None = None,
) -> Lock:
    """What to acquire: a :class:`Lock` on ``name``; nothing is acquired yet.

    Acquire it with ``with lock(name) as held:`` (``held`` is the
    :class:`~django_dlock.HeldLock`, with its fencing token), ``async with``,
    ``@lock("invoice:{invoice_id}")`` on a function (the name a template over
    its arguments, acquired per call) or :meth:`Lock.acquire`. The arguments
    are checked here, before any I/O; they are described at :class:`Lock`.
    """
    return Lock(
        name, ttl=ttl, timeout=timeout, backend=backend, metadata=metadata, renew=renew,
        release_on_commit=release_on_commit, using=using,
    )  # fmt: skip
