"""Counters, and models with multi-table inheritance that are locked and fenced.

Fenced in both directions of inheritance:

- ``Item`` is a ``FencedModel`` with ``LockedSaveMixin``; ``Book`` inherits it
  (the fence is on the parent's table).
- ``Place`` is a plain model; ``Warehouse`` inherits it and is the fenced,
  locked one (the fence is on the child's table).
"""

from django.db import models

from django_dlock.fencing import FencedModel
from django_dlock.saves import LockedSaveMixin


class Named(models.Model):
    name = models.CharField(max_length=100, unique=True)

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return self.name


class Counter(Named):
    """Read, add one, write: only a lock keeps concurrent increments whole."""

    value = models.IntegerField(default=0)


class Tally(Named):
    """Incremented by a Celery task."""

    value = models.IntegerField(default=0)


class Account(Named):
    """On the "ledger" database (realproject.routers)."""

    balance = models.IntegerField(default=0)


class Item(LockedSaveMixin, FencedModel, Named):
    lock_key = "item:{pk}"
    # Keep the save's lock until the request's transaction commits.
    release_on_commit = True


class Book(Item):
    sold = models.IntegerField(default=0)


class Place(Named):
    pass


class Warehouse(LockedSaveMixin, FencedModel, Place):
    stock = models.IntegerField(default=0)
    lock_key = "warehouse:{pk}"
    release_on_commit = True

    def __str__(self) -> str:
        return self.name
