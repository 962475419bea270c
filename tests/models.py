"""Models for the fenced and locked save tests (no migrations: the test runner creates them)."""

from __future__ import annotations

from django.db import models

from django_dlock.fencing import FencedModel
from django_dlock.saves import LockedSaveMixin


class Document(FencedModel):
    title = models.CharField(max_length=100)
    body = models.TextField(default="")

    def __str__(self) -> str:
        return self.title


class LockedDocument(LockedSaveMixin, FencedModel):
    lock_backend = "locmem"
    title = models.CharField(max_length=100)

    def __str__(self) -> str:
        return self.title


class LockedNote(LockedSaveMixin):
    lock_backend = "locmem"
    release_on_commit = True
    text = models.CharField(max_length=100)

    def __str__(self) -> str:
        return self.text


class Counter(models.Model):
    """A row that threads read, increment and write back under a lock."""

    value = models.IntegerField(default=0)

    def __str__(self) -> str:
        return str(self.value)
