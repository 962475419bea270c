"""The parking part of the contract: :class:`ParkingBackend`, opt-in, for Celery's ``defer``.

``@locked_task(on_locked="defer")`` parks a task that found its lock or
semaphore full in a queue kept on the lock service, and the run that ends
sends it again. A backend that keeps such queues derives from
:class:`ParkingBackend` and implements its four primitives, each documented
below with its rule; ``supports_parking`` is then True, and the Celery
integration checks it. An entry has no lease: it stays until it is unparked.
"""

from __future__ import annotations

from typing import ClassVar

from .base import BaseLockBackend
from .types import ParkedTask


class ParkingBackend(BaseLockBackend):
    """A backend that keeps the queues of parked Celery tasks: ``do_park`` and the rest."""

    supports_parking: ClassVar[bool] = True

    def do_park(self, name: str, key: str, order: int, payload: str) -> None:
        """Add the entry ``key`` (``order``, ``payload``) to ``name``'s queue, or replace it.

        Atomic on the service; parking the same ``key`` again replaces its
        entry rather than adding a second one.
        """
        raise NotImplementedError

    def do_unpark(self, name: str, count: int) -> list[ParkedTask]:
        """Remove and return the ``count`` entries of ``name`` of smallest ``order``, in order.

        Atomic: two callers never both get one entry. A resend after a lost
        reply must not pop a second batch (Redis keeps a retry marker).
        """
        raise NotImplementedError

    def do_unpark_key(self, name: str, key: str) -> bool:
        """Remove the entry ``key`` of ``name``; whether it was there (then the caller runs it)."""
        raise NotImplementedError

    def do_list_parked(self, prefix: str) -> list[ParkedTask]:
        """The entries of the queues whose names start with ``prefix``."""
        raise NotImplementedError


__all__ = ["ParkingBackend"]
