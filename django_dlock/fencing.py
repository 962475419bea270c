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

from collections.abc import Iterable
from typing import Any, TypeVar, cast

from django.db import models, router, transaction
from django.db.models.deletion import Collector

from .exceptions import StaleWrite

__all__ = ["FenceField", "FencedModel", "fenced_delete", "fenced_update"]

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

    ``delete(fencing_token=t)`` deletes the row, and what it cascades to,
    only if its ``fence`` is not newer than the token; otherwise it raises
    ``StaleWrite`` and deletes nothing. With multi-table inheritance the
    fence is the column of whichever table has it, parent or child.
    """

    fence = FenceField()

    class Meta:
        abstract = True

    _fencing_token: int | None = None
    _fencing_reinsert: bool = False

    def save(self, *args: Any, fencing_token: int | None = None, **kwargs: Any) -> None:
        if fencing_token is None:
            super().save(*args, **kwargs)
            return
        token = _token(fencing_token)
        previous = self.fence
        self._fencing_token = token
        self._fencing_reinsert = bool(kwargs.get("force_insert"))
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
            self._fencing_reinsert = False

    def delete(self, *args: Any, fencing_token: int | None = None, **kwargs: Any) -> Any:
        """``Model.delete()``; with ``fencing_token``, refused if a newer token wrote the row.

        The fence is checked before Django collects what the delete cascades
        to, in the transaction that deletes it all; then the fence of every
        row the delete cascades to, or sets a column of (``SET_NULL``...),
        that is a ``FencedModel``'s. A refusal raises ``StaleWrite`` and
        deletes nothing. A row already gone is deleted again as Django would
        (nothing of it is left to fence).
        """
        if fencing_token is None or self.pk is None:
            return super().delete(*args, **kwargs)
        token = _token(fencing_token)
        using, keep_parents = _delete_arguments(*args, **kwargs)
        using = using or router.db_for_write(type(self), instance=self)
        # A savepoint inside atomic(): a refusal leaves the transaction usable.
        with transaction.atomic(using=using):
            self._fence_for_delete(using, token)
            # Model.delete(), with the fence of the cascade checked between
            # the collection and the DELETEs.
            collector = Collector(using=using, origin=self)
            collector.collect([self], keep_parents=keep_parents)
            _fence_collected(collector, token)
            return collector.delete()

    def _fence_for_delete(self, using: str, token: int) -> None:
        row = _fence_table(type(self))._base_manager.using(using).filter(pk=self.pk)
        # UPDATE ... SET fence = token WHERE pk = %s AND fence <= token: the
        # check and a write lock on the row (on SQLite, on the database) in
        # one statement, held until the delete commits, so no newer holder
        # writes the row between this check and the DELETE.
        if row.filter(fence__lte=token).update(fence=token):
            return
        current = row.values_list("fence", flat=True).first()
        if current is not None:
            raise StaleWrite(
                f"{self._meta.label} {self.pk!r} was written with fencing token "
                f"{current}, newer than {token}: this delete is refused.",
            )

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
        field = self._meta.get_field("fence")
        if token is None or base_qs.model._meta.concrete_model is not _fence_table(type(self)):
            # Unfenced, or the UPDATE of another table of a multi-table
            # inheritance chain (Django saves each parent's table, then the
            # child's): only the table with the fence column is fenced. The
            # chain's saves run in one transaction, so a refusal there rolls
            # back the others.
            return super()._do_update(base_qs, using, pk_val, values, *rest, **kwargs)
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
                raise self._deleted_since_loaded(token)
        return updated

    def _do_insert(self, *args: Any, **kwargs: Any) -> Any:
        # Multi-table inheritance: when a parent's UPDATE (unfenced, its table
        # has no fence) matches nothing, Django INSERTs the parent's row, then
        # the child's, and never runs the fenced UPDATE. Any INSERT in a
        # fenced save of a loaded row means the row was deleted since.
        token = self._fencing_token
        if token is not None and not self._state.adding and not self._fencing_reinsert:
            raise self._deleted_since_loaded(token)
        return super()._do_insert(*args, **kwargs)  # type: ignore[misc]

    def _deleted_since_loaded(self, token: int) -> StaleWrite:
        return StaleWrite(
            f"{self._meta.label} {self.pk!r} was deleted after it was loaded: a fenced "
            f"save with token {token} does not re-create it. To re-create it on "
            "purpose, save(fencing_token=..., force_insert=True).",
        )


def _fence_table(model: type[models.Model]) -> type[models.Model]:
    """The model whose own table has ``model``'s fence column: itself, or a parent."""
    return model._meta.get_field("fence").model._meta.concrete_model  # type: ignore[return-value]


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


def fenced_delete(queryset: models.QuerySet[M], fencing_token: int) -> tuple[int, dict[str, int]]:
    """``queryset.delete()`` as a fenced write: all rows or none.

    Rows whose ``fence`` is newer than the token make it raise ``StaleWrite``
    and nothing is deleted, what the rows cascade to included (the check and
    the delete run in one transaction). Returns what ``QuerySet.delete()``
    returns.
    """
    token = _token(fencing_token)
    with transaction.atomic(using=queryset.db):
        # Write-locks the rows it matches until the delete commits, so no
        # newer holder writes one of them between the check and the DELETE.
        queryset.filter(fence__lte=token).update(fence=token)
        stale = queryset.filter(fence__gt=token).values_list("pk", "fence")[:1]
        for pk, fence in stale:
            raise StaleWrite(
                f"{queryset.model._meta.label} {pk!r} was written with fencing token "
                f"{fence}, newer than {token}: this delete is refused.",
            )
        # fence__lte again: a row that appeared since the check is a newer
        # holder's if its fence is newer, and is left alone. Then what
        # QuerySet.delete() does, with the fence of the cascade checked
        # between the collection and the DELETEs.
        rows = queryset.filter(fence__lte=token)
        if rows.query.distinct_fields or rows._fields is not None:
            return rows.delete()  # type: ignore[no-any-return]  # raises TypeError
        rows = rows._chain()
        rows._for_write = True
        rows.query.select_for_update = False
        rows.query.select_related = False
        rows.query.clear_ordering(force=True)
        collector = Collector(using=rows.db, origin=queryset)
        collector.collect(rows)
        _fence_collected(collector, token)
        deleted, per_model = collector.delete()
    return deleted, per_model


def _delete_arguments(using: Any = None, keep_parents: bool = False) -> tuple[Any, bool]:
    """``Model.delete()``'s arguments, positional or not."""
    return using, keep_parents


def _fence_collected(collector: Collector, token: int) -> None:
    """Fence the rows a delete's ``collector`` will delete or update, or raise ``StaleWrite``.

    A delete cascades to rows other than those it was asked to delete: a
    ``CASCADE`` foreign key's rows, a multi-table child's parent rows, the
    rows whose foreign key ``SET_NULL`` (or ``SET``...) changes. Each of
    them that is a ``FencedModel``'s gets ``UPDATE ... SET fence = t WHERE
    ... AND fence <= t``, which also write-locks it until the delete
    commits; if one has a newer fence, a newer holder wrote it and the whole
    delete is refused, in the caller's transaction (rolled back).
    """
    pks: dict[type[models.Model], set[Any]] = {}
    querysets: list[models.QuerySet[Any]] = []
    for model, instances in collector.data.items():
        if _is_fenced(model):
            pks.setdefault(_fence_table(model), set()).update(obj.pk for obj in instances)
    for qs in collector.fast_deletes:
        if _is_fenced(qs.model):
            querysets.append(qs)
    for (_field, _value), batches in collector.field_updates.items():
        for batch in batches:
            if isinstance(batch, models.QuerySet) and batch._result_cache is None:
                if _is_fenced(batch.model):
                    querysets.append(batch)
            else:
                for obj in cast("Iterable[models.Model]", batch):
                    if _is_fenced(type(obj)):
                        pks.setdefault(_fence_table(type(obj)), set()).add(obj.pk)
    for table, keys in pks.items():
        rows = table._base_manager.using(collector.using).filter(pk__in=keys)
        if rows.filter(fence__lte=token).update(fence=token) != len(keys):
            _refuse_newer(rows, token)  # or some are gone already: nothing to fence
    for qs in querysets:
        qs = qs.using(collector.using)
        qs.filter(fence__lte=token).update(fence=token)
        _refuse_newer(qs, token)


def _is_fenced(model: type[models.Model]) -> bool:
    return issubclass(model, FencedModel)


def _refuse_newer(rows: models.QuerySet[Any], token: int) -> None:
    for pk, fence in rows.filter(fence__gt=token).values_list("pk", "fence")[:1]:
        raise StaleWrite(
            f"{rows.model._meta.label} {pk!r}, which the delete cascades to, was written "
            f"with fencing token {fence}, newer than {token}: this delete is refused.",
        )
