"""The pytest plugin of the conformance suite: the backends under test, and their fixtures.

A test that takes ``backend_alias`` runs once per alias of the Django setting
``CONFORMANCE_BACKENDS`` (alias in ``DLOCK_BACKENDS`` -> the ``DATABASES``
alias its tests need, or None). ``UNAVAILABLE_BACKENDS`` (alias -> reason),
if set, skips an alias with that reason. ``python -m django_dlock.testing``
sets both, with the one alias ``"under_test"``; django-dlock's own
``tests/settings.py`` sets every backend it ships.

Markers: ``backends(*aliases)`` runs a test on those aliases only (tests of
django-dlock's own backends: skipped, saying so, where none of them is under
test); ``with_default_db``: the test also uses the "default" database.
Fixtures: ``backend`` (the backend of ``backend_alias``), ``name`` (a lock
name no other test uses), ``short_ttl`` and ``past_expiry`` (a lease that
must run out during a test, and how long to wait until it has).

Load it with ``-p django_dlock.testing.plugin``, or ``pytest_plugins`` in a
top-level ``conftest.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.conf import settings

from django_dlock import locks
from django_dlock.backends.base import BaseLockBackend

#: Leases that must expire during a test are this short (or the backend's
#: shortest lease), and tests wait twice that, plus how late the backend may
#: delete an expired lease.
SHORT_TTL = 0.4


def conformance_backends() -> dict[str, str | None]:
    """The aliases under test, each with the ``DATABASES`` alias its tests need (or None)."""
    under_test: dict[str, str | None] = getattr(settings, "CONFORMANCE_BACKENDS", {})
    return under_test


def backend_settings(alias: str) -> dict[str, Any]:
    """The ``DLOCK_BACKENDS`` entry of ``alias``, for a process the test starts."""
    entries: dict[str, dict[str, Any]] = getattr(settings, "DLOCK_BACKENDS", {})
    return dict(entries[alias])


def backend_params(
    aliases: list[str] | None = None, *, with_default_db: bool = False
) -> list[Any]:
    """One pytest param per backend under test, marked with the database it needs.

    ``with_default_db``: the test also uses the "default" database (the
    admin's users, sessions and log), whatever the backend.
    """
    unavailable: dict[str, str] = getattr(settings, "UNAVAILABLE_BACKENDS", {})
    params: list[Any] = []
    for alias, database in conformance_backends().items():
        if aliases is not None and alias not in aliases:
            continue
        reason = unavailable.get(alias)
        needed = {database, "default"} if with_default_db else {database}
        databases = sorted(d for d in needed if d is not None)
        if reason:
            marks = [pytest.mark.skip(reason=reason)]
        elif database is None and not with_default_db:
            marks = []
        else:
            marks = [pytest.mark.django_db(transaction=True, databases=databases)]
        params.append(pytest.param(alias, marks=marks, id=alias))
    if not params and aliases is not None:
        # A test of some of django-dlock's own backends: none of them is under test.
        reason = "a test of django-dlock's own backends " + ", ".join(aliases)
        params.append(pytest.param(None, marks=[pytest.mark.skip(reason=reason)], id="none"))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_alias" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("backends")
        aliases = list(marker.args) if marker else None
        with_default_db = metafunc.definition.get_closest_marker("with_default_db") is not None
        metafunc.parametrize(
            "backend_alias", backend_params(aliases, with_default_db=with_default_db)
        )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backends(*aliases): run a backend_alias test on these backends only"
    )
    config.addinivalue_line(
        "markers",
        "with_default_db: a backend_alias test that also uses the default database",
    )
    config.addinivalue_line("markers", "multiprocess: spawns real processes")


@pytest.fixture
def backend(backend_alias: str) -> BaseLockBackend:
    """The backend under test."""
    return locks[backend_alias]


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A lock name no other test uses, so leases left by one test never meet another."""
    return f"t:{request.node.name}:{uuid.uuid4().hex[:8]}"


@pytest.fixture
def short_ttl(backend: BaseLockBackend) -> float:
    """A lease that must run out during the test: SHORT_TTL, or the backend's shortest."""
    return max(SHORT_TTL, backend.min_ttl)


@pytest.fixture
def past_expiry(backend: BaseLockBackend, short_ttl: float) -> float:
    """How long after a ``short_ttl`` lease was granted it is certainly gone."""
    return short_ttl * 2 + backend.expiry_slack


@pytest.fixture
def ping_expected(backend_alias: str) -> tuple[str, tuple[str, ...]]:
    """What ``ping()`` must report: a pattern its version matches, and text in each warning.

    Here any version that is not blank, and no warning. A host project that
    knows its servers overrides it (django-dlock's ``tests/conftest.py`` does).
    """
    return r"\S", ()
