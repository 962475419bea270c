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


class DocumentNote(models.Model):
    """A row that a Document's delete cascades to."""

    document = models.ForeignKey(Document, on_delete=models.CASCADE, related_name="notes")
    text = models.CharField(max_length=100, default="")

    def __str__(self) -> str:
        return self.text


class FencedParent(FencedModel):
    """Multi-table inheritance, the fence in the parent's table."""

    title = models.CharField(max_length=100)

    def __str__(self) -> str:
        return self.title


class ChildOfFenced(FencedParent):
    extra = models.CharField(max_length=100, default="")


class PlainParent(models.Model):
    """Multi-table inheritance, the fence in the child's table."""

    title = models.CharField(max_length=100)

    def __str__(self) -> str:
        return self.title


class FencedChildOfPlain(PlainParent, FencedModel):
    extra = models.CharField(max_length=100, default="")


class LockedChildOfFenced(LockedSaveMixin, FencedParent):
    lock_backend = "locmem"
    note = models.CharField(max_length=100, default="")


class LockedOrder(LockedSaveMixin, FencedModel):
    """The docs' Order: a locked, fenced save held until the transaction commits."""

    lock_backend = "locmem"
    release_on_commit = True
    status = models.CharField(max_length=20, default="new")
    total = models.IntegerField(default=0)

    def __str__(self) -> str:
        return self.status


class FencedNote(FencedModel):
    """A fenced row that a Document's delete cascades to (review of issue 27, item 8)."""

    document = models.ForeignKey(Document, on_delete=models.CASCADE, related_name="fenced_notes")
    text = models.CharField(max_length=100, default="")

    def __str__(self) -> str:
        return self.text


class FencedTag(FencedModel):
    """A fenced row whose foreign key a Document's delete sets to NULL."""

    document = models.ForeignKey(
        Document, on_delete=models.SET_NULL, null=True, related_name="fenced_tags"
    )

    def __str__(self) -> str:
        return str(self.pk)


class LockedPlace(LockedSaveMixin, FencedModel):
    """Multi-table inheritance under LockedSaveMixin: a parent, its child and a proxy."""

    lock_backend = "locmem"
    visits = models.IntegerField(default=0)

    def __str__(self) -> str:
        return str(self.visits)


class LockedRestaurant(LockedPlace):
    menu = models.CharField(max_length=100, default="")


class LockedPlaceProxy(LockedPlace):
    class Meta:
        proxy = True


class LockedRestaurantProxy(LockedRestaurant):
    class Meta:
        proxy = True
