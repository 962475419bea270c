"""System checks for ``DLOCK_BACKENDS``.

Ids are stable and never reused (docs/checks.md lists them):

- ``django_dlock.E001``: ``DLOCK_BACKENDS`` or one of its entries is not a dict.
- ``django_dlock.E002``: there is no ``"default"`` alias.
- ``django_dlock.E003``: ``BACKEND`` is missing, cannot be imported, or is not a lock backend.
- ``django_dlock.E004``: an unknown settings key or ``OPTIONS`` key.
- ``django_dlock.E005``: ``TTL`` is not a positive number of seconds.
- ``django_dlock.E006``: another value the backend cannot work with.
- ``django_dlock.E007``: the database backend is used but ``django_dlock`` is not installed.
- ``django_dlock.E008``: the database backend's database is missing or unsupported.
- ``django_dlock.W001``: Redlock over an even number of masters.
- ``django_dlock.W002``: a locked Celery task's lock TTL is shorter than the
  broker's ``visibility_timeout`` (registered by ``celery.py``).
- ``django_dlock.W003``: a list ``LOCATION`` on ``RedisBackend`` means
  Redlock; use ``RedlockBackend``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from django.apps import AppConfig
from django.core import checks

from . import conf
from .exceptions import LockConfigurationError
from .handler import backend_class, validate_backends_setting


@checks.register()
def check_backends(
    app_configs: Iterable[AppConfig] | None = None, **kwargs: Any
) -> Iterator[checks.CheckMessage]:
    """Build each configured backend (no network) and yield what is wrong with it."""
    try:
        setting = validate_backends_setting(conf.backends_setting())
    except LockConfigurationError as e:
        yield checks.Error(str(e), id=e.check_id)
        return
    for alias, params in setting.items():
        try:
            backend = backend_class(alias, params)(alias, params)
        except LockConfigurationError as e:
            yield checks.Error(str(e), obj=f"DLOCK_BACKENDS[{alias!r}]", id=e.check_id)
            continue
        yield from backend.check()
