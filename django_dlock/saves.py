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
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from django.db import models, router

from . import conf, keys
from .fencing import FencedModel
from .handle import HeldLock
from .lock import lock
from .transactions import release_at_transaction_end

DEFAULT_KEY = "{app_label}.{model_name}:{pk}"


class _InstanceValues:
    """A template's values for ``instance``: ``app_label``, ``model_name``, then attributes."""

    def __init__(self, instance: models.Model) -> None:
        self.instance = instance

    def __getitem__(self, key: str) -> Any:
        if key == "app_label":
            return self.instance._meta.app_label
        if key == "model_name":
            return self.instance._meta.model_name
        return getattr(self.instance, key)


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


def lock_name(instance: models.Model, template: str = DEFAULT_KEY) -> str:
    """Deprecated alias of :func:`instance_lock_name`."""
    warnings.warn(
        "django_dlock.saves.lock_name() is deprecated; use instance_lock_name().",
        DeprecationWarning,
        stacklevel=2,
    )
    return instance_lock_name(instance, template)


class _SaveUnder:
    """The save ``_under_lock`` runs: fenced with the lock's token on a FencedModel."""

    def __init__(
        self,
        instance: models.Model,
        save: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.fenced = isinstance(instance, FencedModel) and "fencing_token" not in kwargs
        self.save, self.args, self.kwargs = save, args, kwargs

    def __call__(self, held: HeldLock) -> HeldLock:
        if self.fenced:
            self.save(*self.args, fencing_token=held.token, **self.kwargs)
        else:
            self.save(*self.args, **self.kwargs)
        return held


def _unlocked(instance: models.Model, method: str) -> Callable[..., Any]:
    """``instance.<method>``, past LockedSaveMixin's, which would take the same lock again."""
    if isinstance(instance, LockedSaveMixin):
        return getattr(super(LockedSaveMixin, instance), method)  # type: ignore[no-any-return]
    return getattr(instance, method)  # type: ignore[no-any-return]


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
) -> Any:
    name = instance_lock_name(instance, key)
    with keys.templated(key):
        held = lock(name, backend=backend, ttl=ttl, timeout=timeout).acquire()
    db = using or router.db_for_write(type(instance), instance=instance)
    try:
        result = write(held)
    except BaseException:
        held.release_quietly()
        raise
    if not (release_on_commit and release_at_transaction_end(held, db, body_raised=False)):
        held.release()
    return result


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
    handle (released, or to be released at commit).
    """
    write = _SaveUnder(instance, _unlocked(instance, "save"), (), save_kwargs)
    return _under_lock(  # type: ignore[no-any-return]
        instance,
        write,
        key=key,
        backend=backend,
        ttl=ttl,
        timeout=timeout,
        release_on_commit=release_on_commit,
        using=save_kwargs.get("using"),
    )


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
    """``instance.delete(**delete_kwargs)`` while holding the instance's lock."""
    delete = _unlocked(instance, "delete")
    return _under_lock(
        instance,
        lambda held: delete(**delete_kwargs),
        key=key,
        backend=backend,
        ttl=ttl,
        timeout=timeout,
        release_on_commit=release_on_commit,
        using=delete_kwargs.get("using"),
    )


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
        write = _SaveUnder(self, super().save, args, kwargs)
        _under_lock(self, write, using=kwargs.get("using"), **self._lock_options())

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        plain_delete = super().delete
        return _under_lock(
            self,
            lambda held: plain_delete(*args, **kwargs),
            using=kwargs.get("using"),
            **self._lock_options(),
        )

    def _lock_options(self) -> dict[str, Any]:
        return {
            "key": self.lock_key,
            "backend": self.lock_backend,
            "ttl": self.lock_ttl,
            "timeout": self.lock_timeout,
            "release_on_commit": self.release_on_commit,
        }
