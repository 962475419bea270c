"""The aliased backend handler behind ``django_dlock.locks``.

Shaped like Django's ``caches`` and ``task_backends``: ``DLOCK_BACKENDS`` is read
on first use, each alias's ``BACKEND`` is imported with ``import_string`` and
instantiated lazily, and a ``setting_changed`` receiver (at the end of this
module, as in ``django.core.cache``) resets the handler so that
``override_settings`` just works.

Unlike ``caches``, one backend instance serves the whole process rather than
one per thread: the watchdog thread renews leases through the same instance
that granted them, and network backends keep one session per process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.connection import BaseConnectionHandler
from django.utils.module_loading import import_string

from . import conf
from .backends.base import BaseLockBackend
from .exceptions import InvalidBackendError, LockConfigurationError

if TYPE_CHECKING:
    _HandlerBase = BaseConnectionHandler[BaseLockBackend]
else:
    _HandlerBase = BaseConnectionHandler


def validate_backends_setting(value: Any) -> dict[str, dict[str, Any]]:
    """Return the effective ``DLOCK_BACKENDS``, raising for a shape that cannot work."""
    if value is None:
        return {alias: dict(params) for alias, params in conf.DEFAULT_BACKENDS.items()}
    if not isinstance(value, dict):
        raise LockConfigurationError(
            "DLOCK_BACKENDS must be a dict mapping aliases to backend settings, "
            f"not {type(value).__name__}.",
            check_id="django_dlock.E001",
        )
    for alias, params in value.items():
        if not isinstance(alias, str):
            raise LockConfigurationError(
                f"DLOCK_BACKENDS aliases must be strings, not {alias!r}.",
                check_id="django_dlock.E001",
            )
        if not isinstance(params, dict):
            raise LockConfigurationError(
                f"DLOCK_BACKENDS[{alias!r}] must be a dict of settings, "
                f"not {type(params).__name__}.",
                alias=alias,
                check_id="django_dlock.E001",
            )
    if conf.DEFAULT_ALIAS not in value:
        raise LockConfigurationError(
            f"DLOCK_BACKENDS must define a {conf.DEFAULT_ALIAS!r} alias; it has "
            f"{sorted(value)!r}.",
            check_id="django_dlock.E002",
        )
    return value


def backend_class(alias: str, params: dict[str, Any]) -> type[BaseLockBackend]:
    """Import ``params["BACKEND"]``: a lock backend class (a ``BaseLockBackend`` subclass)."""
    path = params.get("BACKEND")
    if not path or not isinstance(path, str):
        raise InvalidBackendError(
            f"DLOCK_BACKENDS[{alias!r}] needs a 'BACKEND' dotted path, such as "
            "'django_dlock.backends.redis.RedisBackend'.",
            alias=alias,
        )
    try:
        cls = import_string(path)
    except ImportError as e:
        raise InvalidBackendError(
            f"Could not import BACKEND {path!r} for lock backend {alias!r}: {e}", alias=alias
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, BaseLockBackend)):
        raise InvalidBackendError(
            f"BACKEND {path!r} for lock backend {alias!r} is not a BaseLockBackend subclass.",
            alias=alias,
        )
    return cls


class LockBackendHandler(_HandlerBase):
    settings_name = "DLOCK_BACKENDS"
    exception_class = InvalidBackendError

    def __init__(self) -> None:
        super().__init__()
        self._mutex = threading.Lock()
        self._backends: dict[str, BaseLockBackend] = {}

    def configure_settings(self, settings: Any) -> dict[str, dict[str, Any]]:
        return validate_backends_setting(conf.backends_setting() if settings is None else settings)

    def create_connection(self, alias: str) -> BaseLockBackend:
        params = self.settings[alias]
        return backend_class(alias, params)(alias, params)

    def __getitem__(self, alias: str) -> BaseLockBackend:
        backend = self._backends.get(alias)
        if backend is not None:
            return backend
        with self._mutex:
            backend = self._backends.get(alias)
            if backend is None:
                if alias not in self.settings:
                    raise self.exception_class(
                        f"No lock backend {alias!r} in DLOCK_BACKENDS; configured: "
                        f"{sorted(self.settings)!r}.",
                        alias=alias,
                    )
                backend = self._backends[alias] = self.create_connection(alias)
        return backend

    def __iter__(self) -> Iterator[str]:
        return iter(self.settings)

    def all(self, initialized_only: bool = False) -> list[BaseLockBackend]:
        if initialized_only:
            return list(self._backends.values())
        return [self[alias] for alias in self]

    def close_all(self) -> None:
        for backend in self.all(initialized_only=True):
            backend.close()

    def reset(self) -> None:
        """Forget the settings and the backends; handles already granted keep theirs.

        A backend with leases held here is not closed: closing an etcd
        backend revokes its leases, and a handle granted before
        ``override_settings(DLOCK_BACKENDS=...)`` would hold a lock the
        service had let go. It is freed with its last handle.
        """
        from .watchdog import get_watchdog  # the watchdog imports the backends' users

        with self._mutex:
            backends, self._backends = self._backends, {}
            self._settings = None
            self.__dict__.pop("settings", None)
        watchdog = get_watchdog()
        for alias, backend in backends.items():
            held = watchdog.scheduled(alias)  # renewed leases; etcd knows renew=False ones
            if getattr(backend, "holds_leases", False):
                continue
            if not any(getattr(h.backend, "base", h.backend) is backend for h in held):
                backend.close()


locks = LockBackendHandler()


@receiver(setting_changed)
def reset_on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    """``override_settings(DLOCK_BACKENDS=...)``: read the setting and make backends anew."""
    if setting == "DLOCK_BACKENDS":
        conf.clear_cache()
        locks.reset()
