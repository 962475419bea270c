"""Model saves and deletes under a lock: ``LockedSaveMixin`` and ``locked_save()``.

The lock's name is a template over the instance: ``{app_label}``,
``{model_name}``, ``{pk}`` and any attribute (``"{app_label}.{model_name}:{pk}"``
is the default). When the model is a ``FencedModel``, the save is also fenced
with the lock's token, so a holder that paused past its lease cannot
overwrite a newer holder's row.

``release_on_commit=True`` keeps the lock until the surrounding transaction
ends. Inside ``transaction.atomic()`` the release is registered with
``transaction.on_commit()``. If the transaction, or the savepoint the save
ran in, rolls back instead, Django drops that callback, and the lock is
released as the callback is freed. That relies on CPython freeing it at once
(reference counting). Elsewhere the lease is released when the callback is
garbage-collected, or ends at its TTL. Outside a transaction the lock is
released as soon as the save returns.

A save or delete whose thread (or asyncio task) already holds the
instance's lock on the same backend, taken by a save or delete still under
way or waiting for its commit, or by ``with lock(name)``, writes under that
lease and its token instead of waiting for itself: a ``post_save`` receiver
that saves again, two saves in one ``atomic()`` with ``release_on_commit``,
a save inside ``with lock(instance_lock_name(obj))``, a ``@lock(...)``-decorated
call, a guarded view or a locked task of the same name. Whoever took the
lease releases it. Only a lease on the mutex is reused: a semaphore's slot
or a read/write lock's lease of the same name is another lock. The lease is
confirmed on the lock service first (``held.ensure()``): one that ran out or
was broken raises ``LockLost`` from the save.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from django.db import models, router, transaction

from . import conf, keys
from .fencing import FencedModel
from .held import HeldLock
from .lock import leases_here, lock
from .transactions import release_at_transaction_end

__all__ = ["LockedSaveMixin", "instance_lock_name", "locked_delete", "locked_save", "row_model"]

DEFAULT_KEY = "{app_label}.{model_name}:{pk}"


class _InstanceValues:
    """A template's values for ``instance``: ``app_label``, ``model_name``, then attributes."""

    def __init__(self, instance: models.Model) -> None:
        self.instance = instance

    def __getitem__(self, key: str) -> Any:
        if key == "app_label":
            return row_model(type(self.instance))._meta.app_label
        if key == "model_name":
            return row_model(type(self.instance))._meta.model_name
        return getattr(self.instance, key)


def row_model(model: type[models.Model]) -> type[models.Model]:
    """The model whose table holds ``model``'s primary key row: the root of its chain.

    A proxy's concrete model; with multi-table inheritance, the topmost
    parent the primary key links to (a child's primary key is the link to
    its parent's row). A ``Restaurant(Place)``, a proxy of either and the
    ``Place`` itself name one row, so they name one lock.
    """
    model = model._meta.concrete_model or model
    while True:
        pk = model._meta.pk
        remote = getattr(pk, "remote_field", None)
        if pk is None or remote is None or not getattr(remote, "parent_link", False):
            return model
        model = remote.model._meta.concrete_model


def _needs_pk(instance: models.Model, template: str) -> bool:
    """Whether ``template`` names the primary key ``instance`` does not have yet."""
    return instance.pk is None and "pk" in keys.parse(template).fields


def instance_lock_name(instance: models.Model, template: str = DEFAULT_KEY) -> str:
    """The lock name ``template`` gives for ``instance``."""
    if _needs_pk(instance, template):
        raise ValueError(
            f"Cannot lock {type(instance).__name__} by {template!r} before it has a primary key."
        )
    return keys.parse(template).fill(_InstanceValues(instance))


class _Fenced:
    """The write ``_under_lock`` runs: fenced with the lock's token on a FencedModel.

    ``write`` is the model's ``save`` or ``delete``, past LockedSaveMixin's.
    """

    def __init__(
        self,
        instance: models.Model,
        write: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.fenced = isinstance(instance, FencedModel) and "fencing_token" not in kwargs
        self.write, self.args, self.kwargs = write, args, kwargs

    def __call__(self, held: HeldLock) -> Any:
        if self.fenced:
            return self.write(*self.args, fencing_token=held.token, **self.kwargs)
        return self.write(*self.args, **self.kwargs)


def _unlocked(instance: models.Model, method: str) -> Callable[..., Any]:
    """``instance.<method>``, past LockedSaveMixin's, which would take the same lock again."""
    if isinstance(instance, LockedSaveMixin):
        return getattr(super(LockedSaveMixin, instance), method)  # type: ignore[no-any-return]
    return getattr(instance, method)  # type: ignore[no-any-return]


class _Holding:
    """An instance lock a save or delete of this thread (or task) holds.

    ``until`` is set once the release waits for the end of a transaction: a
    do-nothing ``on_commit`` callback registered with it. Django drops it at
    the commit, or at the rollback of the transaction or savepoint, and from
    then on the lease is not this thread's to use (its release may be under
    way on another thread).
    """

    def __init__(self, held: HeldLock) -> None:
        self.held = held
        self.until: weakref.ref[_Pending] | None = None

    def usable(self) -> bool:
        held = self.held
        if held.released or held.detached or held.inherited:
            return False
        return self.until is None or self.until() is not None


class _Pending:
    def __call__(self) -> None:
        pass


# The instance locks held by this thread's (or task's) saves and deletes, so
# that a save inside a save of the same instance (a post_save receiver, a
# second save in one atomic() with release_on_commit) uses the lease it
# already holds instead of waiting for itself until LockTimeout.
_holding: ContextVar[tuple[_Holding, ...]] = ContextVar("django_dlock_saves_holding", default=())


def _held_here(backend: str, name: str) -> HeldLock | None:
    """The lease on ``name`` that this thread or task holds already, if any.

    One of its own saves' (above), or one taken with ``with lock(name)``,
    ``lock(name).acquire()``, a ``@lock(...)``-decorated call, a guarded view
    or a locked task running here.
    """
    for holding in reversed(_holding.get()):
        if _is_the_mutex(holding.held, backend, name) and holding.usable():
            return _confirmed(holding.held)
    for held in _context_leases():
        if _is_the_mutex(held, backend, name) and not (
            held.released or held.detached or held.inherited
        ):
            return _confirmed(held)
    return None


def _is_the_mutex(held: HeldLock, backend: str, name: str) -> bool:
    """Whether ``held`` is a lease on the mutex ``name`` of ``backend``.

    Not a semaphore's slot nor a read/write lock's lease, read or write, of
    the same name (``semaphore(name)``, ``rwlock(name)``, a guarded view with
    a ``limit``): those live in a keyspace of their own, with tokens of their
    own, and do not keep another thread from holding the mutex.
    """
    return held.name == name and held.alias == backend and held.ops.limit is None


def _confirmed(held: HeldLock) -> HeldLock:
    """``held``, once the lock service confirms it is still ours (``held.ensure()``).

    A lease that ran out, or was broken, raises ``LockLost``: another holder
    may have the lock now, and writing under the lost lease (or taking a new
    one behind the back of the code that believes it holds the old) would
    not be what that code locked for.
    """
    held.ensure()
    return held


def _context_leases() -> Iterator[HeldLock]:
    """The leases taken in this thread or task by the other ways in, innermost first."""
    from . import views

    yield from leases_here()
    yield from views.leases_here()
    # The task adapters only when in use: celery.py imports Celery.
    for adapter in ("django_dlock.task_framework", "django_dlock.celery"):
        module = sys.modules.get(adapter)
        if module is not None:
            yield from module.leases_here()


def _keep(holding: _Holding) -> None:
    _holding.set((*(h for h in _holding.get() if h.usable()), holding))


def _drop(holding: _Holding) -> None:
    _holding.set(tuple(h for h in _holding.get() if h is not holding and h.usable()))


def _under_lock(
    instance: models.Model,
    write: Callable[[HeldLock], Any],
    *,
    key: str,
    backend: str,
    ttl: float | None,
    timeout: float | None,
    release_on_commit: bool,
    using: str | None,
) -> tuple[HeldLock, Any]:
    name = instance_lock_name(instance, key)
    held = _held_here(backend, name)
    if held is not None:
        # The same thread holds it: write under that lease. Its holder releases it.
        return held, write(held)
    held = lock(name, backend=backend, ttl=ttl, timeout=timeout).acquire_handle(template=key)
    db = using or router.db_for_write(type(instance), instance=instance)
    holding = _Holding(held)
    _keep(holding)
    try:
        result = write(held)
        deferred = release_on_commit and release_at_transaction_end(held, db, body_raised=False)
    except BaseException:
        _drop(holding)
        held.release_quietly()
        raise
    if deferred:
        pending = _Pending()
        holding.until = weakref.ref(pending)
        transaction.on_commit(pending, using=db)
    else:
        _drop(holding)
        held.release()
    return held, result


def locked_save(
    instance: models.Model,
    *,
    key: str = DEFAULT_KEY,
    backend: str = conf.DEFAULT_ALIAS,
    ttl: float | None = None,
    timeout: float | None = 10,
    release_on_commit: bool = False,
    **save_kwargs: Any,
) -> HeldLock:
    """``instance.save(**save_kwargs)`` while holding the instance's lock.

    Fenced with the lock's token when the model is a ``FencedModel``. Raises
    ``LockTimeout`` if the lock is not acquired within ``timeout`` seconds,
    and ``StaleWrite`` if a newer holder has written the row. Returns the
    handle (released, or to be released at commit), or the lease this thread
    already held on the name, which its holder releases.
    """
    write = _Fenced(instance, _unlocked(instance, "save"), (), save_kwargs)
    held, _ = _under_lock(
        instance,
        write,
        key=key,
        backend=backend,
        ttl=ttl,
        timeout=timeout,
        release_on_commit=release_on_commit,
        using=save_kwargs.get("using"),
    )
    return held


def locked_delete(
    instance: models.Model,
    *,
    key: str = DEFAULT_KEY,
    backend: str = conf.DEFAULT_ALIAS,
    ttl: float | None = None,
    timeout: float | None = 10,
    release_on_commit: bool = False,
    **delete_kwargs: Any,
) -> Any:
    """``instance.delete(**delete_kwargs)`` while holding the instance's lock.

    Fenced with the lock's token when the model is a ``FencedModel``: if a
    newer holder has written the row, ``StaleWrite`` is raised and nothing is
    deleted. Returns what ``delete()`` returns.
    """
    write = _Fenced(instance, _unlocked(instance, "delete"), (), delete_kwargs)
    _, deleted = _under_lock(
        instance,
        write,
        key=key,
        backend=backend,
        ttl=ttl,
        timeout=timeout,
        release_on_commit=release_on_commit,
        using=delete_kwargs.get("using"),
    )
    return deleted


class LockedSaveMixin(models.Model):
    """``save()`` and ``delete()`` take the instance's lock (see ``locked_save``).

    Class attributes: ``lock_key`` (a template, default
    ``"{app_label}.{model_name}:{pk}"``), ``lock_backend``, ``lock_ttl``,
    ``lock_timeout`` and ``release_on_commit``. A new instance is saved
    without the lock when the key needs a primary key it does not have yet.
    """

    lock_key: str = DEFAULT_KEY
    lock_backend: str = conf.DEFAULT_ALIAS
    lock_ttl: float | None = None
    lock_timeout: float | None = 10
    release_on_commit: bool = False

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        if _needs_pk(self, self.lock_key):
            super().save(*args, **kwargs)
            return
        write = _Fenced(self, super().save, args, kwargs)
        _under_lock(self, write, using=kwargs.get("using"), **self._lock_options())

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        write = _Fenced(self, super().delete, args, kwargs)
        _, deleted = _under_lock(self, write, using=kwargs.get("using"), **self._lock_options())
        return deleted

    def _lock_options(self) -> dict[str, Any]:
        return {
            "key": self.lock_key,
            "backend": self.lock_backend,
            "ttl": self.lock_ttl,
            "timeout": self.lock_timeout,
            "release_on_commit": self.release_on_commit,
        }
