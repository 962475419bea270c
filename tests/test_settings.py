"""DLOCK_BACKENDS handling, the zero-config default and the system checks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import Error
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

import django_dlock.checks
from django_dlock import lock, locks
from django_dlock.backends.database import DatabaseBackend
from django_dlock.backends.locmem import LocMemBackend
from django_dlock.checks import check_backends
from django_dlock.exceptions import (
    InvalidBackendError,
    InvalidLockOption,
    InvalidTTL,
    LockConfigurationError,
)

LOCMEM = "django_dlock.backends.locmem.LocMemBackend"
DB = "django_dlock.backends.database.DatabaseBackend"


def errors_for(setting: Any) -> list[Error]:
    with override_settings(DLOCK_BACKENDS=setting):
        return list(check_backends())


def test_absent_setting_means_database_backend_on_default(settings: Any) -> None:
    del settings.DLOCK_BACKENDS
    backend = locks["default"]
    assert isinstance(backend, DatabaseBackend)
    assert backend.database == "default"
    assert backend.default_ttl == 30
    assert list(check_backends()) == []


def test_default_ttl_is_30_seconds(settings: Any) -> None:
    settings.DLOCK_BACKENDS = {"default": {"BACKEND": LOCMEM}}
    with lock("ttl-default") as held:
        assert held.ttl == 30
        assert held.holder["ttl"] == 30


def test_handler_is_lazy_and_reset_on_setting_changed() -> None:
    with override_settings(DLOCK_BACKENDS={"default": {"BACKEND": LOCMEM, "TTL": 5}}):
        first = locks["default"]
        assert isinstance(first, LocMemBackend)
        assert first.default_ttl == 5
        assert locks["default"] is first
    assert isinstance(locks["default"], DatabaseBackend)


def test_one_backend_instance_per_process_not_per_thread() -> None:
    import threading

    seen = []
    thread = threading.Thread(target=lambda: seen.append(locks["locmem"]))
    thread.start()
    thread.join()
    assert seen == [locks["locmem"]]


def test_unknown_alias() -> None:
    with pytest.raises(InvalidBackendError, match="nope"):
        locks["nope"]
    with pytest.raises(ImproperlyConfigured):
        lock("x", backend="nope").acquire()


@pytest.mark.parametrize(
    ("setting", "check_id", "mentions"),
    [
        (["not", "a", "dict"], "django_dlock.E001", "must be a dict"),
        ({"default": "redis://"}, "django_dlock.E001", "'default'"),
        ({"other": {"BACKEND": LOCMEM}}, "django_dlock.E002", "'default'"),
        ({"default": {}}, "django_dlock.E003", "'default'"),
        ({"default": {"BACKEND": "no.such.Backend"}}, "django_dlock.E003", "no.such.Backend"),
        ({"default": {"BACKEND": "django.db.models.Model"}}, "django_dlock.E003", "Model"),
        (
            {"default": {"BACKEND": LOCMEM, "OPTIONS": {"fair": True}}},
            "django_dlock.E004",
            "fair",
        ),
        ({"default": {"BACKEND": LOCMEM, "TIMEOUT": 3}}, "django_dlock.E004", "TIMEOUT"),
        ({"default": {"BACKEND": LOCMEM, "TTL": 0}}, "django_dlock.E005", "'default'"),
        ({"default": {"BACKEND": LOCMEM, "TTL": -1}}, "django_dlock.E005", "TTL"),
        ({"default": {"BACKEND": LOCMEM, "TTL": "30"}}, "django_dlock.E005", "TTL"),
        ({"default": {"BACKEND": LOCMEM, "TTL": float("inf")}}, "django_dlock.E005", "TTL"),
        ({"default": {"BACKEND": LOCMEM, "OPTIONS": []}}, "django_dlock.E006", "OPTIONS"),
        ({"default": {"BACKEND": DB, "LOCATION": "x"}}, "django_dlock.E006", "LOCATION"),
        (
            {"default": {"BACKEND": DB, "OPTIONS": {"database": "missing"}}},
            "django_dlock.E008",
            "missing",
        ),
    ],
)
def test_checks(setting: Any, check_id: str, mentions: str) -> None:
    errors = errors_for(setting)
    assert [e.id for e in errors] == [check_id], errors
    assert mentions in errors[0].msg


def test_each_error_names_its_alias() -> None:
    errors = errors_for(
        {
            "default": {"BACKEND": LOCMEM},
            "reports": {"BACKEND": LOCMEM, "TTL": 0},
            "jobs": {"BACKEND": LOCMEM, "OPTIONS": {"bogus": 1}},
        }
    )
    assert sorted(e.id for e in errors) == ["django_dlock.E004", "django_dlock.E005"]
    assert any("'reports'" in e.msg for e in errors)
    assert any("'jobs'" in e.msg and "LocMemBackend" in e.msg for e in errors)


def test_database_backend_needs_the_app(settings: Any) -> None:
    settings.INSTALLED_APPS = [a for a in settings.INSTALLED_APPS if a != "django_dlock"]
    errors = errors_for({"default": {"BACKEND": DB}})
    assert [e.id for e in errors] == ["django_dlock.E007"]


def test_manage_py_check_reports_bad_settings() -> None:
    with override_settings(DLOCK_BACKENDS={"default": {"BACKEND": LOCMEM, "TTL": 0}}):
        with pytest.raises(SystemCheckError, match=r"django_dlock\.E005"):
            call_command("check")
    call_command("check")


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"BACKEND": LOCMEM, "TTL": 0}, InvalidTTL),
        ({"BACKEND": LOCMEM, "OPTIONS": {"x": 1}}, InvalidLockOption),
        ({"BACKEND": "no.such.Backend"}, InvalidBackendError),
    ],
)
def test_using_a_bad_backend_raises_a_configuration_error(
    params: dict[str, Any], error: type[LockConfigurationError]
) -> None:
    with override_settings(DLOCK_BACKENDS={"default": {"BACKEND": LOCMEM}, "bad": params}):
        with pytest.raises(error) as excinfo:
            locks["bad"]
    assert excinfo.value.alias == "bad"
    assert isinstance(excinfo.value, ImproperlyConfigured)


def test_key_prefix_separates_namespaces() -> None:
    with override_settings(
        DLOCK_BACKENDS={
            "default": {"BACKEND": LOCMEM, "KEY_PREFIX": "a"},
            "b": {"BACKEND": LOCMEM, "KEY_PREFIX": "b"},
        }
    ):
        with lock("shared-name") as a, lock("shared-name", backend="b", timeout=0) as b:
            assert [i.name for i in locks["default"].list("shared")] == ["shared-name"]
            assert [i.token for i in locks["b"].list("shared")] == [b.token]
            assert a.token != 0


def test_every_check_id_is_listed() -> None:
    """Each check id the package uses is in checks.py's docstring and docs/checks.md."""
    root = Path(django_dlock.__file__).parent
    used = set()
    for path in root.rglob("*.py"):
        used.update(re.findall(r"django_dlock\.[EW]\d{3}", path.read_text()))
    assert {"django_dlock.E001", "django_dlock.W001", "django_dlock.W002"} <= used
    docstring = django_dlock.checks.__doc__ or ""
    table = (root.parent / "docs" / "checks.md").read_text()
    assert sorted(used - set(re.findall(r"``(django_dlock\.[EW]\d{3})``", docstring))) == []
    assert sorted(used - set(re.findall(r"\| `(django_dlock\.[EW]\d{3})` \|", table))) == []


def test_a_backend_reports_the_dotted_path_it_was_configured_with() -> None:
    """``locks check`` and settings errors name the path from the settings, not a submodule."""
    from django.conf import settings

    from django_dlock import locks

    for alias in ("etcd", "redis", "redlock", "db-sqlite"):
        configured = settings.DLOCK_BACKENDS[alias]["BACKEND"]
        assert locks[alias].path == configured
        assert configured.count(".") == 3, configured  # django_dlock.backends.<name>.<Class>


@pytest.mark.parametrize("token", ["", "   ", 12345, b"bytes-token"])
def test_a_metrics_token_no_scraper_could_present_is_an_error(token: Any) -> None:
    from django_dlock.checks import check_metrics_token

    with override_settings(DLOCK_METRICS_TOKEN=token):
        errors = list(check_metrics_token())
    assert [e.id for e in errors] == ["django_dlock.E009"]
    assert "12345" not in errors[0].msg and "bytes-token" not in errors[0].msg  # never shown


def test_a_metrics_token_that_is_a_str_or_unset_passes() -> None:
    from django_dlock.checks import check_metrics_token

    with override_settings(DLOCK_METRICS_TOKEN="a-long-random-token"):
        assert list(check_metrics_token()) == []
    assert list(check_metrics_token()) == []
