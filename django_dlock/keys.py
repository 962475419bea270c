"""Lock-name templates: the one mechanism behind every templated lock name.

A template is ``str.format`` syntax whose fields name values:
``"invoice:{invoice_id}"``, ``"{invoice.pk}"`` (attributes), ``"{row[0]}"``
(items), ``"{{"`` for a literal brace. Fields must be named; ``{}`` and
``{0}`` are refused where the template is made. A template without fields is
a fixed name.

Where the values come from depends on the caller, never on the syntax:

- ``@lock(...)`` and Celery's ``LockedTask``: the call's arguments
  (:class:`KeyTemplate` given the function's signature, checked where the
  function is decorated).
- ``@lock_view`` and ``LockRequiredMixin``: the URL's keyword arguments,
  ``user`` and ``user_pk`` (:func:`django_dlock.views.view_lock_name`).
- ``locked_save``, ``locked_delete`` and ``LockedSaveMixin``: the instance's
  ``app_label``, ``model_name`` and attributes
  (:func:`django_dlock.saves.instance_lock_name`).
"""

from __future__ import annotations

import functools
import inspect
import string
from collections.abc import Mapping
from typing import Any, Protocol


class Values(Protocol):
    """What a template is filled from: anything indexable by field name."""

    def __getitem__(self, key: str, /) -> Any: ...


def template_fields(template: str) -> frozenset[str]:
    """The names a template's fields start with: ``"inv:{inv.pk}"`` -> ``{"inv"}``.

    Raises ``ValueError`` for a positional field (``{}``, ``{0}``).
    """
    roots = set()
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(
                f"Lock key template {template!r} must name arguments, as in 'invoice:{{id}}'."
            )
        roots.add(root)
    return frozenset(roots)


class KeyTemplate:
    """A lock-name template, parsed and checked once, filled per use.

    With ``signature`` (and the function's ``qualname`` for the message), the
    fields must name parameters of that signature (unless it takes
    ``**kwargs``), and :meth:`format` fills the template from a call's
    arguments: defaults apply, and ``**kwargs`` contribute their keys.
    """

    def __init__(
        self,
        template: str,
        signature: inspect.Signature | None = None,
        qualname: str = "",
    ) -> None:
        if not isinstance(template, str):
            raise TypeError(f"A lock key template must be a str, not {type(template).__name__}.")
        self.template = template
        self.signature = signature
        #: The names the fields start with.
        self.fields = template_fields(template)
        self._static = None if self.fields else template.format()
        self._var_keyword: list[str] = []
        # Parameter names, when every parameter may be passed by position or
        # by keyword and none has a default: then a call's arguments are
        # zipped with them, which costs a fraction of Signature.bind (the key
        # is made for every Celery message).
        self._plain: tuple[str, ...] | None = None
        if signature is not None:
            params = signature.parameters.values()
            if all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params):
                self._plain = tuple(signature.parameters)
            self._var_keyword = [
                p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD
            ]
            missing = self.fields - set(signature.parameters)
            if missing and not self._var_keyword:
                raise ValueError(
                    f"Lock key {template!r} names {sorted(missing)!r}, which "
                    f"{qualname}() does not take."
                )

    def __repr__(self) -> str:
        return f"<KeyTemplate {self.template!r}>"

    def fill(self, values: Values) -> str:
        """The name for ``values``; a field ``values`` lacks raises what its lookup raises."""
        if self._static is not None:
            return self._static
        return self.template.format_map(values)

    def arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults applied, ``**kwargs`` merged in."""
        if self.signature is None:
            raise TypeError(f"{self!r} was made without a signature.")
        plain = self._plain
        if plain is not None and len(args) + len(kwargs) == len(plain):
            values = dict(zip(plain, args, strict=False))
            if all(name in plain[len(args) :] for name in kwargs):
                values.update(kwargs)
                return values
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        for name in self._var_keyword:
            values.update(values.pop(name, {}))
        return values

    def format(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The name for a call with ``args`` and ``kwargs``."""
        if self._static is not None:
            return self._static
        return self.fill(self.arguments(args, kwargs))


@functools.lru_cache(maxsize=512)
def parse(template: str) -> KeyTemplate:
    """``KeyTemplate(template)``, parsed once per distinct template string."""
    return KeyTemplate(template)
