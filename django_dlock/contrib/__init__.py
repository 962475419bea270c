"""Optional integrations: each module needs its own extra installed."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from django.dispatch import Signal

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


class Receivers:
    """Signal receivers connected and disconnected together, each one quiet."""

    receivers: list[tuple[Signal, Callable[..., None]]]

    def connect(self) -> None:
        for signal, receiver in self.receivers:
            signal.connect(
                quiet_receiver(receiver), weak=False, dispatch_uid=(id(self), receiver.__name__)
            )

    def disconnect(self) -> None:
        for signal, receiver in self.receivers:
            signal.disconnect(dispatch_uid=(id(self), receiver.__name__))

    def forked(self) -> None:
        """In a child process after ``fork()``: replace what a thread of the parent may hold."""


R = TypeVar("R", bound=Receivers)


class Installation(Generic[R]):
    """An integration's one installation in a process: what ``install()`` connected."""

    def __init__(self) -> None:
        self.current: R | None = None
        self._mutex = threading.Lock()
        os.register_at_fork(after_in_child=self._forked)

    def install(self, make: Callable[[], R]) -> R:
        """Make and connect it, unless it is installed already: then that one."""
        with self._mutex:
            if self.current is None:
                receivers = make()
                receivers.connect()
                self.current = receivers
            return self.current

    def uninstall(self) -> None:
        with self._mutex:
            if self.current is not None:
                self.current.disconnect()
                self.current = None

    def _forked(self) -> None:
        # A mutex held by another thread at fork() stays held in the child.
        self._mutex = threading.Lock()
        if self.current is not None:
            self.current.forked()
