"""The lease accounting of a held handle, and the watchdog's side of it.

:class:`LeaseAccounting` is the part of :class:`~django_dlock.handle.HeldLock`
that keeps the estimate of when its lease ends, and its renewals. The
estimate is never later than the service's end:

A request (a hand extend or a renewal) sent at ``sent`` with ``ttl`` that
lands on the service sets the lease's end to at least ``sent + ttl``
(it lands no earlier than it was sent). The estimate rests on the
confirmed request sent last, C, and is lowered by every request that may
have landed after C (one still in flight, one that failed after C was
sent, one answered after C was sent): such a request R landed no
earlier than C was sent, so the end is at least ``C.sent + R.ttl``. A
reply sent before C's changes nothing else, and a request whose reply
(or error) came before C was sent landed before C. The next renewal is
due a third of the estimated length after C was sent.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, cast

from .watchdog import get_watchdog

if TYPE_CHECKING:
    from .backends.base import BaseLockBackend
    from .handle import HeldLock

# The states of a handle.
HELD, RELEASED, LOST, DETACHED = "held", "released", "lost", "detached"

#: Seconds between renewal retries after an error, as a fraction of the TTL.
RETRY_FRACTION = 0.1


class LeaseAccounting:
    """The renewals and the lease accounting of :class:`~django_dlock.handle.HeldLock`.

    Its only subclass is ``HeldLock``: ``cast("HeldLock", self)`` tells the
    type checker so where the watchdog is handed the handle.
    """

    backend: BaseLockBackend
    ttl: float
    renewing: bool
    _mutex: threading.Lock
    _state: str
    _expires: float
    _renew_enabled: bool
    _forgotten: weakref.finalize[..., Any] | None
    _expiry_cell: list[float]
    #: The request whose reply the estimate rests on: (sent, ttl, lease length).
    _confirmed: tuple[float, float]
    #: Requests sent (extends and renewals) that might still land after it.
    _requests: list[Request]

    if TYPE_CHECKING:

        @property
        def alias(self) -> str: ...

        @property
        def expires_in(self) -> float: ...

        def _mark_lost(self, reason: str) -> None: ...

    # --- the watchdog's side: only ``watchdog.py`` and ``renewer.py`` call these -----

    def on_watchdog(self, due: float) -> None:
        """The watchdog thread's turn (the renewal was due at ``due``): queue a renewal.

        It never waits on the lock service: the backend's renewal thread
        (``renewer.Renewer``) sends it, in a batch, and marks the lease lost
        if it runs out before its renewal comes back.
        """
        if self._state != HELD or self.renewing:
            return
        self.renewing = True
        get_watchdog().renewer(self.alias).add(cast("HeldLock", self), due)

    def renewal_wanted(self) -> bool:
        """Whether a queued renewal is still to be sent (False once released or lost)."""
        if self._state == HELD:
            return True
        self.renewing = False
        return False

    def renewal_lost(self, reason: str) -> None:
        """The lease ran out before its renewal was sent, or came back."""
        self.renewing = False
        self._mark_lost(reason)

    def renewal_sending(self) -> Request:
        """The renewal thread sends a renewal now, with the handle's TTL: its record."""
        return self._sending(self.ttl)

    def renewal_done(self, request: Request, result: bool | Exception) -> Exception | None:
        """What the renewal ``request`` returned; the error if it raised one."""
        self.renewing = False
        if isinstance(result, Exception):
            self._answered(request, None)
            if self._state != HELD:
                return None
            remaining = self.expires_in
            if remaining <= 0:
                self._mark_lost(f"renewal failed until the lease ran out: {result!r}")
            else:
                delay = min(self.ttl * RETRY_FRACTION, remaining / 2, 1.0)
                get_watchdog().schedule(cast("HeldLock", self), delay)
            return result
        self._answered(request, result)
        if self._state == HELD and not result:
            self._mark_lost("renewal was refused: the lease expired or was broken")
        return None

    def _sending(self, ttl: float) -> Request:
        """Record a request about to be sent with ``ttl``: until answered it may land any time."""
        request = Request(time.monotonic(), ttl)
        with self._mutex:
            self._requests.append(request)
            end = request.sent + ttl - self.backend.drift(ttl)
            if end >= self._expires:
                return request
            # A shorter TTL: the lease may end sooner from the moment it lands.
            self._set_expires(end)
            renewing = self.renewing
        self._reschedule(renewing, ttl / 3, end)
        return request

    def _answered(self, request: Request, granted: bool | None) -> None:
        """``request`` was granted (True), refused (False) or failed (None, it may have landed)."""
        now = time.monotonic()
        with self._mutex:
            if request.answered is None:
                request.answered = now
            confirmed_sent, confirmed_ttl = self._confirmed
            if granted and request.sent >= confirmed_sent:
                self._confirmed = confirmed_sent, confirmed_ttl = request.sent, request.ttl
            drift = self.backend.drift
            end = confirmed_sent + confirmed_ttl - drift(confirmed_ttl)
            kept = []
            for other in self._requests:
                if other.answered is not None and other.answered <= confirmed_sent:
                    continue  # answered before C was sent: it landed before C
                kept.append(other)
                end = min(end, max(other.sent, confirmed_sent) + other.ttl - drift(other.ttl))
            self._requests = kept
            if self._state != HELD:
                return
            sooner = end < self._expires
            self._set_expires(end)
            due = confirmed_sent + (end - confirmed_sent) / 3
            renewing = self.renewing
        if not renewing or sooner:
            self._reschedule(renewing, max(0.0, due - now), end)

    def _reschedule(self, renewing: bool, delay: float, end: float) -> None:
        """Renew in ``delay`` s; or, with a renewal under way, judge it at its new ``end``."""
        if renewing:
            get_watchdog().renewer(self.alias).judge_by(cast("HeldLock", self), end)
        elif self._renew_enabled:
            get_watchdog().schedule(cast("HeldLock", self), delay)

    def _set_expires(self, end: float) -> None:
        """Under the mutex."""
        self._expires = end
        if self._forgotten is not None:
            self._expiry_cell[0] = end


class Request:
    """An extend or renewal of a handle: sent at ``sent`` (``time.monotonic()``) with ``ttl``."""

    __slots__ = ("answered", "sent", "ttl")

    def __init__(self, sent: float, ttl: float) -> None:
        self.sent = sent
        self.ttl = ttl
        #: When its reply or error came back; None while in flight.
        self.answered: float | None = None
