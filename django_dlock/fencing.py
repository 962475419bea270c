"""Fenced writes: the database refuses a write that carries an older fencing token.

A lock alone cannot keep a paused holder from writing. etcd's ``contrib/lock``
demo and Kleppmann's "How to do distributed locking" walk through it:

- t0 A acquires the lock with token 33.
- t1 A pauses (a GC, SIGSTOP, a slow network).
- t2 A's lease expires, and B acquires with token 34.
- t3 B writes with 34.
- t4 A resumes. It still believes it holds the lock, and it writes with 33.

Checking the lock just before the write does not help: A can pause between
the check and the write. Only the storage can see both writes, so only the
storage can refuse the stale one. Here the storage is the Django database:
``FencedModel`` keeps the token of the last fenced write in its ``fence``
column. ``obj.save(fencing_token=t)`` then becomes
``UPDATE ... WHERE pk = %s AND fence <= t``, and a row whose ``fence`` is
newer is left untouched while ``StaleWrite`` is raised.

The comparison is ``<=``, not ``<``. A token is issued once per acquisition
of a name, so an equal token is the same lease writing again (a second
``save()`` under one lock), which must not fail.
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.db import models, router, transaction

from .exceptions import StaleWrite

M = TypeVar("M", bound=models.Model)


class FenceField(models.BigIntegerField):  # type: ignore[type-arg]
    """The fencing token of the last fenced write to the row (0: none yet)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        kwargs.setdefault("editable", False)
        kwargs.setdefault("help_text", "Fencing token of the last fenced write.")
        super().__init__(*args, **kwargs)


def _token(token: object) -> int:
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"fencing_token must be an int, not {type(token).__name__}.")
    return token


class FencedModel(models.Model):
    """An abstract model whose saves can be fenced: ``save(fencing_token=held.token)``.

    A fenced save of an existing row updates it only if its ``fence`` is not
    newer than the token, in the same UPDATE statement, and stores the token
    in ``fence``. Otherwise it raises ``StaleWrite`` and changes nothing.
    A fenced save of a new row inserts it with ``fence`` = the token. A
    fenced save of a row loaded from the database that has since been deleted
    raises ``StaleWrite`` instead of inserting it again (the delete may be a
    newer holder's); ``save(fencing_token=t, force_insert=True)`` re-creates
    it on purpose. A save without a token works as usual and leaves
    ``fence`` as it is.
    """

    fence = FenceField()

    class Meta:
        abstract = True

    _fencing_token: int | None = None

    def save(self, *args: Any, fencing_token: int | None = None, **kwargs: Any) -> None:
        if fencing_token is None:
            super().save(*args, **kwargs)
            return
        token = _token(fencing_token)
        previous = self.fence
        self._fencing_token = token
        self.fence = token
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        try:
            if transaction.get_connection(using).in_atomic_block:
                # In a savepoint: Django marks the transaction of a failed
                # save for rollback, and a refused write must leave it usable.
                with transaction.atomic(using=using):
                    super().save(*args, **kwargs)
            else:
                super().save(*args, **kwargs)  # no transaction to keep usable
        except BaseException:
            self.fence = previous
            raise
        finally:
            self._fencing_token = None

    def _do_update(  # type: ignore[override]
        self,
        base_qs: Any,
        using: Any,
        pk_val: Any,
        values: list[Any],
        update_fields: Any,
        forced_update: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # Django's own save path (signals, parents, update_fields) calls this
        # for the UPDATE; a fenced save adds the fence to its WHERE and SET.
        # Django 4.2-5.2 pass the six parameters above and take back a bool
        # (a row was updated). Django 6.0 adds returning_fields (in ``args``)
        # and takes back a list of returned rows. Either way the rest is
        # passed through, and the result is falsy exactly when no row was
        # updated. tests/test_fencing.py pins the signature on each version.
        token = self._fencing_token
        rest = (update_fields, forced_update, *args)
        if token is None:
            return super()._do_update(base_qs, using, pk_val, values, *rest, **kwargs)
        field = self._meta.get_field("fence")
        values = [v for v in values if v[0] is not field] + [(field, None, token)]
        fenced = base_qs.filter(fence__lte=token)
        updated = super()._do_update(fenced, using, pk_val, values, *rest, **kwargs)
        if not updated:
            current = base_qs.filter(pk=pk_val).values_list("fence", flat=True).first()
            if current is not None:
                raise StaleWrite(
                    f"{self._meta.label} {pk_val!r} was written with fencing token "
                    f"{current}, newer than {token}: this write is refused.",
                )
            if not self._state.adding:
                # Django would now INSERT the row again. It was loaded from
                # the database, so someone deleted it since, possibly a newer
                # holder (locked_delete): bringing it back would undo that.
                raise StaleWrite(
                    f"{self._meta.label} {pk_val!r} was deleted after it was loaded: a fenced "
                    f"save with token {token} does not re-create it. To re-create it on "
                    "purpose, save(fencing_token=..., force_insert=True).",
                )
        return updated


def fenced_update(queryset: models.QuerySet[M], fencing_token: int, **values: Any) -> int:
    """``queryset.update(**values)`` as a fenced write: all rows or none.

    Rows whose ``fence`` is newer than the token make it raise ``StaleWrite``
    and nothing is updated (the update and the check run in one transaction,
    which is rolled back). Returns the number of rows updated, which now have
    ``fence`` = the token.
    """
    token = _token(fencing_token)
    with transaction.atomic(using=queryset.db):
        updated = queryset.filter(fence__lte=token).update(fence=token, **values)
        stale = queryset.filter(fence__gt=token).values_list("pk", "fence")[:1]
        for pk, fence in stale:
            raise StaleWrite(
                f"{queryset.model._meta.label} {pk!r} was written with fencing token "
                f"{fence}, newer than {token}: this update is refused.",
            )
    return int(updated)
