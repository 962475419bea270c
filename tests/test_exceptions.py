"""Every error of the package survives pickling: Celery sends a task's error to its caller so."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from django_dlock import exceptions
from django_dlock.backends.types import BoundElsewhere
from django_dlock.celery.parking import NoParking


def every_error() -> list[BaseException]:
    made: list[BaseException] = []
    for cls in [
        *(
            value
            for value in vars(exceptions).values()
            if isinstance(value, type)
            and issubclass(value, BaseException)
            and value.__module__ == exceptions.__name__
        ),
        BoundElsewhere,
        NoParking,
    ]:
        if issubclass(cls, exceptions.LimitMismatch):
            made.append(cls("held with 7", name="n", backend="b", limit=2, held_limit=7))
        elif issubclass(cls, exceptions.BackendUnavailable):
            made.append(cls("down", name="n", backend="b", transient=False))
        elif issubclass(cls, exceptions.DLockError):
            made.append(cls("oops", name="n", backend="b"))
        elif issubclass(cls, exceptions.LockConfigurationError):
            made.append(cls("bad", alias="b", check_id="django_dlock.E099"))
    return made


@pytest.mark.parametrize("error", every_error(), ids=lambda e: type(e).__name__)
def test_an_error_comes_back_whole_from_pickle(error: BaseException) -> None:
    """Its class, message and attributes: a LimitMismatch stays one (and a ValueError)."""
    back: Any = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)


@pytest.mark.parametrize("error", every_error(), ids=lambda e: type(e).__name__)
def test_an_error_comes_back_as_its_class_from_celerys_json(error: BaseException) -> None:
    """Celery's json result serializer rebuilds an error as ``cls(*args)``: it must work.

    Review of issue 30: ``LimitMismatch`` took required keywords, so a caller
    got a plain ``Exception`` instead.
    """
    from celery import Celery
    from celery.backends.base import BaseBackend

    backend = BaseBackend(Celery(set_as_current=False), serializer="json")
    back = backend.exception_to_python(backend.prepare_exception(error))
    assert type(back) is type(error) and str(back) == str(error)


def test_every_error_class_is_covered() -> None:
    """A new error class with its own required arguments must be added above."""
    classes = {type(e) for e in every_error()}
    assert exceptions.LimitMismatch in classes and NoParking in classes
    assert len(classes) >= 14, sorted(c.__name__ for c in classes)
