from __future__ import annotations

import warnings
from typing import Any

from django.db import models


class Lease(models.Model):
    """The database backend's row per lock name.

    The row is kept after release so that ``fence`` keeps counting: a fencing
    token is never issued twice for a name. Times are microseconds since the
    epoch by the database server's clock; the backend's SQL never compares
    them with the client's clock.
    """

    digest = models.CharField(
        max_length=64,
        primary_key=True,
        help_text="SHA-256 of KEY_PREFIX and name: names may be longer than an index allows.",
    )
    namespace = models.CharField(max_length=255, default="", help_text="The backend's KEY_PREFIX.")
    name = models.TextField()
    fence = models.BigIntegerField(help_text="The last fencing token issued for this name.")
    # NULL, not "", means free: the acquire statement tests "owner IS NULL".
    owner = models.CharField(  # noqa: DJ001
        max_length=64, null=True, help_text="Owner token of the holder; NULL when free."
    )
    acquired_at_us = models.BigIntegerField(null=True)
    expires_at_us = models.BigIntegerField(null=True, db_index=True)
    holder = models.TextField(default="", help_text="Holder metadata as JSON.")

    class Meta:
        verbose_name = "lease"
        verbose_name_plural = "leases"

    def __str__(self) -> str:
        return self.name


class LockListing(models.Model):
    """The admin's "Locks" entry: live leases, read from the lock backends.

    No table (``managed = False``): the model exists for the admin's app list,
    its content type (admin log entries of breaks point at it) and the two
    permissions: ``django_dlock.view_lock`` to see holders and
    ``django_dlock.break_lock`` to break a lease. It was called ``Lock``
    until that clashed with :class:`django_dlock.Lock`; migration 0003
    renames it, keeping the content type, permissions and log entries.
    """

    class Meta:
        managed = False
        default_permissions = ()
        permissions = [
            ("view_lock", "Can view held locks"),
            ("break_lock", "Can break held locks"),
        ]
        verbose_name = "lock"
        verbose_name_plural = "locks"

    def __str__(self) -> str:
        return f"lock {self.pk}"


def __getattr__(name: str) -> Any:
    """``django_dlock.models.Lock``: the admin model's old name, deprecated."""
    if name == "Lock":
        warnings.warn(
            "django_dlock.models.Lock is now LockListing (it clashed with django_dlock.Lock).",
            DeprecationWarning,
            stacklevel=2,
        )
        return LockListing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
