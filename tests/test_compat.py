"""Names issue 17 changed keep working for a while, with a DeprecationWarning."""

from __future__ import annotations

import pytest

from django_dlock import locks
from django_dlock.backends.locmem import LocMemBackend


def test_the_admin_models_old_name_still_imports() -> None:
    from django_dlock import models

    with pytest.warns(DeprecationWarning, match="LockListing"):
        from django_dlock.models import Lock
    assert Lock is models.LockListing


def test_old_capability_names_read_the_new_ones() -> None:
    backend = locks["locmem"]
    with pytest.warns(DeprecationWarning, match="supports_wakeups"):
        assert backend.wakes_waiters is backend.supports_wakeups is True  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="supports_multiprocess"):
        assert backend.shared_across_processes is False  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        backend.no_such_thing  # type: ignore[attr-defined]  # noqa: B018


def test_a_subclass_declaring_an_old_name_declares_the_new_one() -> None:
    with pytest.warns(DeprecationWarning, match="declare supports_wakeups"):

        class Polling(LocMemBackend):
            wakes_waiters = False

    assert Polling.supports_wakeups is False
    assert LocMemBackend.supports_wakeups is True
