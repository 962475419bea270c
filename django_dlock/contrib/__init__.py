"""Optional integrations: each module needs its own extra installed."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("django_dlock")


def quiet_receiver(receiver: Callable[..., None]) -> Callable[..., None]:
    """``receiver``, logging what it raises instead of raising it.

    Some signals are sent with ``send()``, where a receiver's error reaches
    the lock's caller (``lock_acquired`` then releases the lease it was
    about): a metric or a span that fails must not fail the lock.
    """

    @functools.wraps(receiver)
    def quiet(*args: Any, **kwargs: Any) -> None:
        try:
            receiver(*args, **kwargs)
        except Exception:
            logger.exception("django-dlock's %s receiver failed", receiver.__qualname__)

    return quiet
