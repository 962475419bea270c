from __future__ import annotations

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
    ``django_dlock.break_lock`` to break a lease. The codenames name what
    they guard, a lock, rather than Django's default ``view_locklisting``.
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


class Slot(models.Model):
    """A holder or waiter of a semaphore or read/write lock (the database backend's).

    A holder has a ``token``; a waiter has none and is recorded so that a
    waiting writer holds back new readers, and so that listings count it.
    Expired rows are deleted by the next acquisition of the name. The
    name's fencing counter is a :class:`Lease` row of its own (its digest
    is taken over ``"slots"``, the prefix and the name).
    """

    digest = models.CharField(max_length=64, db_index=True, help_text="As Lease.digest.")
    namespace = models.CharField(max_length=255, default="", help_text="The backend's KEY_PREFIX.")
    name = models.TextField()
    owner = models.CharField(max_length=64)
    slot_limit = models.BigIntegerField(help_text="The semaphore's limit.")
    weight = models.BigIntegerField(help_text="1, or the whole limit for a writer.")
    token = models.BigIntegerField(null=True, help_text="NULL for a waiter.")
    acquired_at_us = models.BigIntegerField(null=True)
    expires_at_us = models.BigIntegerField(db_index=True)
    holder = models.TextField(default="", help_text="Holder metadata as JSON.")

    class Meta:
        verbose_name = "semaphore slot"
        constraints = [
            models.UniqueConstraint(fields=["digest", "owner"], name="django_dlock_slot_owner")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.owner})"


class ParkedCall(models.Model):
    """A Celery call parked on a full semaphore by ``on_locked="defer"``."""

    digest = models.CharField(max_length=64, db_index=True, help_text="As Lease.digest.")
    namespace = models.CharField(max_length=255, default="", help_text="The backend's KEY_PREFIX.")
    name = models.TextField()
    call_id = models.CharField(max_length=255, help_text="The task id.")
    place = models.BigIntegerField(help_text="Its place in line (smaller first).")
    payload = models.TextField(help_text="What sends it again, as JSON.")

    class Meta:
        verbose_name = "parked call"
        constraints = [
            models.UniqueConstraint(fields=["digest", "call_id"], name="django_dlock_parked_call")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.call_id})"
