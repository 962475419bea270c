"""Lock-guarded views: ``@lock_view(...)`` and ``LockRequiredMixin``.

The lock's name is a template over the URL's keyword arguments, plus
``user`` (``request.user``) and ``user_pk``:
``@lock_view("order:{order_id}")``, ``"cart:{user_pk}"``. While another
request (or process) holds it, the view answers **423 Locked** (or the
``status`` given, such as 409). ``Retry-After`` is set to the holder's
remaining lease, in whole seconds, at least 1. With ``timeout`` it waits up
to that many seconds first. The lock is held while the view runs and
released when it returns or raises, or, when the view runs inside a
transaction (``ATOMIC_REQUESTS``, or an ``atomic()`` around it), when every
such transaction has committed or rolled back (``release_on_commit=False``:
when the view returns). A streamed response's body is sent after the
release. While the view runs, ``request.dlock`` (and :func:`current_lock`)
is the :class:`~django_dlock.HeldLock`: its ``token`` fences the view's writes.

With ``limit=N`` the lock is a semaphore: at most N requests run the view at
once, and the next answers **429 Too Many Requests** (or ``status``), with
``Retry-After`` the shortest remaining lease of the N holders.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.exceptions import BadRequest
from django.http import HttpRequest, HttpResponse

from . import conf, holders, keys
from ._validation import validate_name
from .backends.types import LockInfo
from .exceptions import LockTimeout
from .handler import locks
from .held import HeldLock
from .keys import KeyTemplate
from .lock import Lock
from .semaphores import Semaphore
from .transactions import open_transactions, release_at_transactions_end

__all__ = ["LockRequiredMixin", "current_lock", "lock_view", "locked_response", "view_lock_name"]

V = TypeVar("V", bound=Callable[..., Any])

#: 423 Locked (RFC 4918): the resource is locked by another request.
LOCKED = 423
#: 429 Too Many Requests (RFC 6585): a view's ``limit`` of requests at once is reached.
TOO_MANY = 429


#: The fields that name the request's user rather than a URL argument.
USER_FIELDS = frozenset({"user", "user_pk"})
_USER_UNREAD: Any = object()


def view_lock_name(
    template: str | KeyTemplate,
    request: HttpRequest,
    view_kwargs: Mapping[str, Any],
    *,
    user: Any = _USER_UNREAD,
) -> str:
    """The lock name ``template`` gives for this request.

    Fields name the URL's keyword arguments, ``user`` (``request.user``) and
    ``user_pk``; a field naming anything else raises ``ValueError``. The user
    is read only for a template that names it and no URL argument of that
    name gives it (a URL argument wins: ``staff/users/<user_pk>/`` locks that
    user, not the one asking): ``request.user`` loads the session and the
    user from the database (and makes the response vary on the cookie), which
    an async view may not do on its event loop. There, read it in a thread
    first and pass it as ``user``, as guarded async views do.
    """
    if not isinstance(template, KeyTemplate):
        template = keys.parse(template)
    fields = dict(view_kwargs)
    if _reads_user(template, view_kwargs):
        if user is _USER_UNREAD:
            user = getattr(request, "user", None)
        fields = {"user": user, "user_pk": getattr(user, "pk", None), **view_kwargs}
    try:
        return template.fill(fields)
    except KeyError as e:
        raise ValueError(
            f"Lock key {template.template!r} names {e.args[0]!r}, which is neither a URL "
            f"keyword argument of this view ({sorted(view_kwargs)}) nor user or user_pk."
        ) from None


def locked_response(
    name: str, backend: str, status: int = LOCKED, *, limit: int | None = None
) -> HttpResponse:
    """The answer to a request that found ``name`` held: ``status`` and ``Retry-After``.

    With ``limit``, ``name`` is a semaphore: the shortest lease of its holders.
    """
    if limit is None:
        found = holders.find_holders(name, backend).holders
        what = _held_by(found)
    else:
        semaphore = locks[backend].semaphore(name)
        found = list(semaphore.holders) if semaphore is not None else []
        what = f"busy ({limit} request{'s' if limit > 1 else ''} at once)"
    remaining = min((h.expires_in for h in found), default=1.0)
    retry_after = 1 if not math.isfinite(remaining) else max(1, math.ceil(remaining))
    response = HttpResponse(
        f"{name!r} is {what}; retry after {retry_after} s.\n",
        status=status,
        content_type="text/plain; charset=utf-8",
    )
    response["Retry-After"] = str(retry_after)
    return response


def _held_by(found: list[LockInfo]) -> str:
    """Who holds a guarded view's lock, as a client may be told: a task, or not.

    Not the task's name or id: those are the project's internals.
    """
    holder = found[0].holder if found else {}
    if holder.get("task_name"):
        return "locked by a background task"
    return "locked by another request or process"


class _Guard:
    """What a guarded view needs: the template and how to take the lock."""

    def __init__(
        self,
        key: str,
        *,
        timeout: float | None,
        ttl: float | None,
        backend: str,
        status: int | None,
        metadata: Mapping[str, Any] | None,
        limit: int | None = None,
        release_on_commit: bool = True,
    ) -> None:
        if not isinstance(key, str) or not key:
            raise TypeError("The lock key must be a non-empty str template.")
        if not isinstance(release_on_commit, bool):
            raise TypeError(f"release_on_commit must be True or False, not {release_on_commit!r}.")
        self.release_on_commit = release_on_commit
        self.key = key
        self.template = KeyTemplate(key)
        self.backend, self.limit = backend, limit
        self.status = status if status is not None else (LOCKED if limit is None else TOO_MANY)
        # Validates the options where the view is defined; each request
        # acquires it under its own name.
        options: dict[str, Any] = {
            "ttl": ttl, "timeout": timeout, "backend": backend, "metadata": metadata,
        }  # fmt: skip
        self.lock = (
            Lock(key, **options) if limit is None else Semaphore(key, limit=limit, **options)
        )

    def name_for(
        self, request: HttpRequest, view_kwargs: Mapping[str, Any], user: Any = _USER_UNREAD
    ) -> str:
        """The request's lock name; one no lock service can store is the client's error (400).

        The URL's arguments come from the client: ``/orders/a%00b/`` gives a
        name with a NUL character, which ``acquire()`` refuses with
        ``ValueError``, and that was a 500.
        """
        name = view_lock_name(self.template, request, view_kwargs, user=user)
        try:
            return validate_name(name)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    def run(
        self, request: HttpRequest, view_kwargs: Mapping[str, Any], call: Callable[[], Any]
    ) -> Any:
        name = self.name_for(request, view_kwargs)
        try:
            held = self.lock.acquire_handle(name=name, template=self.template.template)
        except LockTimeout:
            return locked_response(name, self.backend, self.status, limit=self.limit)
        try:
            with _lease_on(request, held):
                result = call()
        except BaseException:
            self._release(held, body_raised=True)
            raise
        self._release(held, body_raised=False)
        return result

    def _release(self, held: HeldLock, *, body_raised: bool) -> None:
        """Now, or when the transactions open around the view end (``ATOMIC_REQUESTS``).

        The view returned: a lease lost meanwhile raises ``LockLost``, so that
        they roll back, their work not having been protected to the end.
        """
        if self.release_on_commit and release_at_transactions_end(
            held, open_transactions(), body_raised=body_raised
        ):
            return
        held.release_quietly()

    async def arun(
        self, request: HttpRequest, view_kwargs: Mapping[str, Any], call: Callable[[], Any]
    ) -> Any:
        user = _USER_UNREAD
        if _reads_user(self.template, view_kwargs):
            # request.user queries the database: in a thread, not on the event
            # loop. request.user, not await request.auser(): a middleware that
            # sets request.user (RemoteUserMiddleware, a token middleware)
            # leaves auser() answering AnonymousUser, and sync views read it too.
            user = await sync_to_async(_request_user)(request)
        name = self.name_for(request, view_kwargs, user)
        try:
            # Native where the backend is.
            held = await self.lock.aacquire_handle(name=name, template=self.template.template)
        except LockTimeout:
            # On the backend's own threads: under load the loop's default
            # executor is busy, and this answer must not wait for it.
            return await asyncio.wrap_future(
                locks[self.backend].offload.submit(
                    "ops", functools.partial(locked_response, limit=self.limit),
                    name, self.backend, self.status,
                )
            )  # fmt: skip
        try:
            with _lease_on(request, held):
                return await call()
        finally:
            await held.arelease_quietly()


def _reads_user(template: KeyTemplate, view_kwargs: Mapping[str, Any]) -> bool:
    """Whether the name needs the request's user: a user field no URL argument gives."""
    return bool((template.fields & USER_FIELDS) - set(view_kwargs))


def _request_user(request: HttpRequest) -> Any:
    """``request.user``, loaded here: it is a lazy object that queries when first read."""
    user = getattr(request, "user", None)
    getattr(user, "pk", None)  # evaluates the lazy object in this thread
    return user


#: The leases of the guarded views running in this thread or task, innermost last.
_running: ContextVar[tuple[HeldLock, ...]] = ContextVar("django_dlock_views", default=())


def leases_here() -> tuple[HeldLock, ...]:
    """The leases of the guarded views running in this thread or task, innermost first."""
    return tuple(reversed(_running.get()))


def current_lock() -> HeldLock | None:
    """The lease of the guarded view that runs here (innermost), else None.

    The same as ``request.dlock`` in the view, for code the view calls
    without its request: ``current_lock().token`` fences its writes.
    """
    running = _running.get()
    return running[-1] if running else None


@contextlib.contextmanager
def _lease_on(request: HttpRequest, held: HeldLock) -> Iterator[None]:
    """``request.dlock`` is ``held`` while the view runs (an outer guard's again after)."""
    outer = request.__dict__.get("dlock", _NONE)
    request.dlock = held  # type: ignore[attr-defined]
    reset = _running.set((*_running.get(), held))
    try:
        yield
    finally:
        _running.reset(reset)
        if outer is _NONE:
            del request.dlock  # type: ignore[attr-defined]
        else:
            request.dlock = outer  # type: ignore[attr-defined]


_NONE = object()


def lock_view(
    key: str,
    *,
    timeout: float | None = 0,
    ttl: float | None = None,
    backend: str = conf.DEFAULT_ALIAS,
    status: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    limit: int | None = None,
    release_on_commit: bool = True,
) -> Callable[[V], V]:
    """Guard a function-based view, sync or async, with the lock ``key`` names.

    ``status``: the answer when it is held (default 423; with ``limit``, 429).
    ``limit``: let that many requests in at once (a semaphore) instead of one.
    ``release_on_commit``: inside a transaction (``ATOMIC_REQUESTS``), hold
    the lock, or the slot, until it commits or rolls back; False: release
    when the view returns, before the commit.
    """
    guard = _Guard(
        key, timeout=timeout, ttl=ttl, backend=backend, status=status, metadata=metadata,
        limit=limit, release_on_commit=release_on_commit,
    )  # fmt: skip

    def decorator(view: V) -> V:
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def async_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                return await guard.arun(request, kwargs, lambda: view(request, *args, **kwargs))

            return _registered(cast(V, async_view))

        @functools.wraps(view)
        def sync_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return guard.run(request, kwargs, lambda: view(request, *args, **kwargs))

        return _registered(cast(V, sync_view))

    def _registered(guarded: V) -> V:
        _guarded[guarded] = (backend, limit)
        return guarded

    return decorator


#: The guarded views: function views (and ``as_view()`` with ``lock_*``
#: options) by their wrapper, the classes by themselves, held weakly.
#: ``manage.py check`` reads them (``django_dlock.W005``: an alias missing
#: from ``DLOCK_BACKENDS``; ``E010``: a limit on a backend without semaphores).
_guarded: weakref.WeakKeyDictionary[Any, tuple[str, int | None]] = weakref.WeakKeyDictionary()
_guarded_classes: weakref.WeakSet[type[LockRequiredMixin]] = weakref.WeakSet()


def guarded_views() -> list[tuple[str, str, int | None]]:
    """The guarded views defined so far: (view, backend alias, limit or None)."""
    found = []
    for view, (backend, limit) in list(_guarded.items()):
        made = getattr(view, "view_class", view)  # as_view(): named by its class
        found.append((f"{made.__module__}.{made.__qualname__}", backend, limit))
    for cls in list(_guarded_classes):
        if cls.lock_key:
            found.append(
                (f"{cls.__module__}.{cls.__qualname__}", cls.lock_backend, cls.lock_limit)
            )
    return sorted(found, key=lambda v: (v[0], v[1], -1 if v[2] is None else v[2]))


#: The options of a ``LockRequiredMixin`` view.
_LOCK_OPTIONS = (
    "lock_key", "lock_timeout", "lock_ttl", "lock_backend", "lock_status", "lock_metadata",
    "lock_limit", "lock_release_on_commit",
)  # fmt: skip


def _guard_of(view: Any) -> _Guard:
    """The guard a ``LockRequiredMixin`` view's (or class's) ``lock_*`` options make."""
    return _Guard(
        view.lock_key,
        timeout=view.lock_timeout,
        ttl=view.lock_ttl,
        backend=view.lock_backend,
        status=view.lock_status,
        metadata=view.lock_metadata,
        limit=view.lock_limit,
        release_on_commit=view.lock_release_on_commit,
    )


class LockRequiredMixin:
    """Guard a class-based view's ``dispatch()`` with a lock, as ``lock_view`` does.

    Set ``lock_key`` (a template over ``self.kwargs``, ``user`` and
    ``user_pk``), and optionally ``lock_timeout`` (0), ``lock_ttl``,
    ``lock_backend`` ("default"), ``lock_status`` (423; 429 with a limit),
    ``lock_metadata``, ``lock_limit`` (None: one request at a time) and
    ``lock_release_on_commit`` (True: under ``ATOMIC_REQUESTS``, held until
    the commit). Works for async views (every handler ``async def``) too.
    The handler finds the lease in ``self.request.dlock``.
    """

    lock_key: str = ""
    lock_timeout: float | None = 0
    lock_ttl: float | None = None
    lock_backend: str = conf.DEFAULT_ALIAS
    lock_status: int | None = None
    lock_metadata: Mapping[str, Any] | None = None
    lock_limit: int | None = None
    lock_release_on_commit: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _guarded_classes.add(cls)
        if cls.lock_key:  # a guarded view (not a base without a key): bad options raise here
            _guard_of(cls)

    def get_lock_guard(self) -> _Guard:
        return _guard_of(self)

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Any:
        """Django's ``as_view()``; ``lock_*`` options given here are checked here too."""
        view = super().as_view(**initkwargs)  # type: ignore[misc]
        given = {key: value for key, value in initkwargs.items() if key.startswith("lock_")}
        if given:
            options = {name: getattr(cls, name) for name in _LOCK_OPTIONS} | given
            _guard_of(SimpleNamespace(**options))  # bad options raise where the view is made
            _guarded[view] = (options["lock_backend"], options["lock_limit"])
        return view

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        guard = self.get_lock_guard()
        parent = super().dispatch  # type: ignore[misc]
        if getattr(self, "view_is_async", False):
            return guard.arun(request, kwargs, lambda: parent(request, *args, **kwargs))
        return guard.run(request, kwargs, lambda: parent(request, *args, **kwargs))
