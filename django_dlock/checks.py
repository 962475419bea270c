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
- ``django_dlock.E009``: ``DLOCK_METRICS_TOKEN`` is set but not a non-empty str.
- ``django_dlock.E010``: a locked task, or a guarded view, with ``limit`` on a
  backend without semaphores.
- ``django_dlock.E011``: a locked Celery task with ``on_locked="defer"`` on a
  backend without a parking queue.
- ``django_dlock.W001``: Redlock over an even number of masters.
- ``django_dlock.W002``: a locked Celery task's lock TTL is shorter than the
  broker's ``visibility_timeout`` (``django_dlock.celery``'s check, registered here).
- ``django_dlock.W003``: not used (ids are never reused).
- ``django_dlock.W004``: a ``LockedSaveMixin`` model (or an inline of one) is
  in an admin whose ``ModelAdmin`` is not a ``LockedModelAdminMixin``: a held
  lock is a 500 there.
- ``django_dlock.W005``: a locked task, a guarded view or a ``LockedSaveMixin``
  model on an alias that ``DLOCK_BACKENDS`` does not have.
- ``django_dlock.W006``: a ZooKeeper backend's ``TTL`` is shorter than its
  session timeout (the backend's own ``check()``): a dead holder's locks last
  the session timeout.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from importlib import import_module
from typing import Any

from django.apps import AppConfig, apps
from django.conf import settings
from django.core import checks
from django.urls import get_resolver

from . import conf
from .exceptions import LockConfigurationError
from .handler import backend_class, locks, validate_backends_setting
from .saves import LockedSaveMixin


@checks.register()
def check_backends(
    app_configs: Iterable[AppConfig] | None = None, **kwargs: Any
) -> Iterator[checks.CheckMessage]:
    """Build each configured backend (no network) and yield what is wrong with it."""
    for _, message in backend_messages():
        yield message


def backend_messages() -> Iterator[tuple[str | None, checks.CheckMessage]]:
    """:func:`check_backends`'s messages, each with the alias it is about.

    None for ``DLOCK_BACKENDS`` as a whole (then no alias is looked at):
    ``manage.py locks`` refuses to start on those, and goes on with the
    backends that have none of their own.
    """
    try:
        setting = validate_backends_setting(conf.backends_setting())
    except LockConfigurationError as e:
        yield None, checks.Error(str(e), id=e.check_id)
        return
    for alias, params in setting.items():
        try:
            backend = backend_class(alias, params)(alias, params)
        except LockConfigurationError as e:
            yield alias, checks.Error(str(e), obj=f"DLOCK_BACKENDS[{alias!r}]", id=e.check_id)
            continue
        try:
            found = backend.check()
        except Exception as e:  # a bug, or a setting a backend's check did not foresee
            found = [
                checks.Error(
                    f"Lock backend {alias!r}: its settings could not be checked: "
                    f"{type(e).__name__}: {e}",
                    obj=f"DLOCK_BACKENDS[{alias!r}]",
                    id="django_dlock.E006",
                )
            ]
        for message in found:
            yield alias, message


@checks.register()
def check_locked_tasks(
    app_configs: Iterable[AppConfig] | None = None, **kwargs: Any
) -> Iterator[checks.CheckMessage]:
    """django_dlock.E010, E011 and W005: a locked task its lock backend cannot serve.

    W005: its alias is not in ``DLOCK_BACKENDS`` (a typo). ``limit`` needs
    semaphores (``supports_semaphores``), Celery's ``on_locked="defer"`` a
    parking queue (``supports_parking``). Without
    them every call would fail in the worker; here they fail at startup.
    The tasks are those of the current Celery app (once Celery is imported:
    listing them imports the apps' ``tasks`` modules) and the task
    framework's tasks defined so far (in the modules imported by now).
    """
    if "celery" in sys.modules:  # the app's tasks may import our adapter only when listed
        with contextlib.suppress(ImportError):
            import_module("django_dlock.celery")
    for adapter in ("django_dlock.celery", "django_dlock.task_framework"):
        module = sys.modules.get(adapter)
        if module is None:
            continue
        for name, options in module.locked_tasks():
            yield from _missing_parts(name, options)


@checks.register()
def check_visibility_timeouts(
    app_configs: Iterable[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """django_dlock.W002: a locked task whose lease may run out before its message is redelivered.

    The check is ``django_dlock.celery.check_visibility_timeout``; it is
    registered here, with the app: a project's tasks modules (and with them
    the adapter) are often first imported while the checks run, which is
    too late for a check the adapter registered itself.
    """
    if "celery" not in sys.modules:
        return []
    try:
        celery_adapter = import_module("django_dlock.celery")
    except ImportError:
        return []
    return list(celery_adapter.check_visibility_timeout())


@checks.register(checks.Tags.urls)
def check_guarded_views(
    app_configs: Iterable[AppConfig] | None = None, **kwargs: Any
) -> Iterator[checks.CheckMessage]:
    """django_dlock.E010 and W005 for a guarded view: ``limit`` on a backend without
    semaphores, or an alias that ``DLOCK_BACKENDS`` does not have.

    The views are those defined by now; the URLconf is loaded first, as
    Django's own URL checks do, so that the project's views are.
    """
    if getattr(settings, "ROOT_URLCONF", None):
        with contextlib.suppress(Exception):  # Django's URL checks report a broken URLconf
            get_resolver().url_patterns  # noqa: B018
    from .views import guarded_views

    for view, alias, limit in guarded_views():
        backend, unknown = _backend_of(alias, f"Guarded view {view!r}", "request", view)
        if unknown is not None:
            yield unknown
        if backend is None or limit is None:
            continue
        if not backend.supports_semaphores:
            yield checks.Error(
                f"Guarded view {view!r} has limit={limit}, but lock backend {alias!r} "
                f"({backend.path}) has no semaphores: every request would fail.",
                hint="Guard it on a backend with semaphores, or drop limit to serve one "
                "request at a time.",
                obj=view,
                id="django_dlock.E010",
            )


def _backend_of(
    alias: str, what: str, each: str, obj: str
) -> tuple[Any, checks.CheckMessage | None]:
    """The backend of ``alias``, or None, with a W005 if the alias is not configured.

    A warning, not an error: tests may add the alias with ``override_settings``
    to views and tasks their modules define, and ``manage.py test`` imports
    those modules before it runs the checks. A configured alias that cannot
    be built is ``check_backends``'s to report.
    """
    try:
        configured = validate_backends_setting(conf.backends_setting())
    except LockConfigurationError:
        return None, None  # check_backends reports DLOCK_BACKENDS
    if alias not in configured:
        return None, checks.Warning(
            f"{what} is locked on backend {alias!r}, which DLOCK_BACKENDS does not have "
            f"(it has {sorted(configured)!r}): every {each} would fail.",
            hint="Correct the alias, or add it to DLOCK_BACKENDS.",
            obj=obj,
            id="django_dlock.W005",
        )
    try:
        return locks[alias], None
    except Exception:
        return None, None  # a broken entry: check_backends reports it


def _missing_parts(task: str, options: Any) -> Iterator[checks.CheckMessage]:
    backend, unknown = _backend_of(options.backend, f"Locked task {task!r}", "call", task)
    if unknown is not None:
        yield unknown
    if backend is None:
        return
    where = f"lock backend {options.backend!r} ({backend.path})"
    if options.limit is not None and not backend.supports_semaphores:
        yield checks.Error(
            f"Locked task {task!r} has limit={options.limit}, but {where} has no "
            "semaphores: every call would fail in the worker.",
            hint="Lock it on a backend with semaphores, or drop limit to run one at a time.",
            obj=task,
            id="django_dlock.E010",
        )
    if options.on_locked == "defer":
        from .celery.parking import has_parking

        if not has_parking(backend):
            yield checks.Error(
                f"Locked task {task!r} has on_locked='defer', but {where} has no parking "
                "queue: every deferred call would fail in the worker.",
                hint="Lock it on a backend with a parking queue, or use another on_locked.",
                obj=task,
                id="django_dlock.E011",
            )


@checks.register(checks.Tags.security)
def check_metrics_token(
    app_configs: Iterable[AppConfig] | None = None, **kwargs: Any
) -> Iterator[checks.CheckMessage]:
    """django_dlock.E009: a ``DLOCK_METRICS_TOKEN`` that no scraper could present.

    An empty one would leave the metrics to logged-in users only, without
    saying so; a number or bytes is compared as its ``str()``, which is not
    what a ``prometheus.yml`` holds.
    """
    token = getattr(settings, "DLOCK_METRICS_TOKEN", None)
    if token is not None and (not isinstance(token, str) or not token.strip()):
        yield checks.Error(
            f"DLOCK_METRICS_TOKEN must be a non-empty str (the bearer token of "
            f"django_dlock.contrib.prometheus.metrics_view), not a {type(token).__name__}"
            f"{' that is blank' if isinstance(token, str) else ''}.",
            hint="Unset it to serve the metrics to logged-in users with view_lock only.",
            id="django_dlock.E009",
        )


@checks.register(checks.Tags.models)
def check_locked_models(
    app_configs: Iterable[AppConfig] | None = None, **kwargs: Any
) -> Iterator[checks.CheckMessage]:
    """django_dlock.W005 for a ``LockedSaveMixin`` model on an alias that is not configured."""
    labels = None if app_configs is None else {config.label for config in app_configs}
    for model in apps.get_models():
        if not issubclass(model, LockedSaveMixin):
            continue
        if labels is not None and model._meta.app_label not in labels:
            continue
        what = f"LockedSaveMixin model {model._meta.label}"
        _, unknown = _backend_of(model.lock_backend, what, "save or delete", model._meta.label)
        if unknown is not None:
            yield unknown


@checks.register(checks.Tags.admin)
def check_locked_models_admin(
    app_configs: Iterable[AppConfig] | None = None, **kwargs: Any
) -> Iterator[checks.CheckMessage]:
    """django_dlock.W004: a ``LockedSaveMixin`` model whose admin lets ``LockTimeout`` out.

    A plain ``ModelAdmin`` saves (or deletes) the instance, its lock is held
    past ``lock_timeout``, and the ``LockTimeout`` becomes a server error.
    The same holds for a ``ModelAdmin`` whose inlines save such a model.
    """
    if not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.sites import all_sites

    from .admin import LockedModelAdminMixin

    # Admin sites defined in the URLconf exist only once it is imported;
    # Django's URL check (run in any order with this one) reports a URLconf
    # that cannot be.
    with contextlib.suppress(Exception):
        import_module(settings.ROOT_URLCONF)
    labels = None if app_configs is None else {config.label for config in app_configs}
    for site in list(all_sites):
        for model, model_admin in list(site._registry.items()):
            if isinstance(model_admin, LockedModelAdminMixin):
                continue
            locked = [
                m
                for m in (model, *(inline.model for inline in model_admin.inlines))
                if issubclass(m, LockedSaveMixin)
                and (labels is None or m._meta.app_label in labels)
            ]
            for found in locked:
                how = "" if found is model else f" as an inline of {model._meta.label}"
                yield checks.Warning(
                    f"{found._meta.label} is a LockedSaveMixin model in admin site "
                    f"{site.name!r}{how} with {type(model_admin).__name__}, which is not a "
                    "LockedModelAdminMixin: a save or delete there that finds the "
                    "instance's lock held is a server error (LockTimeout).",
                    hint=(
                        "Register it with django_dlock.admin.LockedModelAdmin, or add "
                        "django_dlock.admin.LockedModelAdminMixin to the bases of "
                        f"{type(model_admin).__name__}: a held lock is then refused with a "
                        "message."
                    ),
                    obj=type(model_admin),
                    id="django_dlock.W004",
                )
