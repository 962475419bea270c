"""The capabilities' names before issue 17, still declared and read, with a warning.

``wakes_waiters`` is now ``supports_wakeups`` and ``shared_across_processes``
is ``supports_multiprocess`` (Django's ``supports_*``). A backend class that
declares an old name gets the new one set from it; reading an old name reads
the new one. Both warn with ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

#: Capability names before issue 17 -> their names now.
RENAMED_CAPABILITIES = {
    "wakes_waiters": "supports_wakeups",
    "shared_across_processes": "supports_multiprocess",
}


class RenamedCapabilities:
    """Mixed into :class:`~.base.BaseLockBackend`: the old names, declared or read."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in RENAMED_CAPABILITIES.items():
            if old in cls.__dict__:
                warnings.warn(
                    f"{cls.__qualname__}.{old} is deprecated: declare {new} instead.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                setattr(cls, new, cls.__dict__[old])

    if not TYPE_CHECKING:  # mypy would take any attribute of a backend as valid

        def __getattr__(self, name: str) -> Any:
            # Only for attributes not found otherwise: the capabilities' old names.
            new = RENAMED_CAPABILITIES.get(name)
            if new is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            warnings.warn(
                f"{name} is deprecated: read {new} instead.", DeprecationWarning, stacklevel=2
            )
            return getattr(self, new)
