"""The lease accounting of a held handle, the watchdog's side of it, and its end.

:class:`LeaseAccounting` is the part of :class:`~django_dlock.held.HeldLock`
that keeps the estimate of when its lease ends, and its renewals, and marks
it lost and sends ``lock_lost``, ``lock_released`` and ``lock_detached``
(always with ``sender=`` the backend's class) when it ends. The
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

import functools
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, cast

from django.dispatch import Signal

from .backends.protocol import Request as Request
from .dispatch import get_dispatcher, send_robust
from .signals import lock_lost, lock_released
from .watchdog import get_watchdog

if TYPE_CHECKING:
    from .backends.protocol import LockService, Renewable

logger = logging.getLogger("django_dlock")

# The states of a handle.
HELD, RELEASED, LOST, DETACHED = "held", "released", "lost", "detached"

#: Seconds between renewal retries after an error, as a fraction of the TTL.
RETRY_FRACTION = 0.1


class LeaseAccounting:
    """The renewals and the lease accounting of :class:`~django_dlock.held.HeldLock`.

    Its only subclass is ``HeldLock``: ``cast("Renewable", self)`` tells the
    type checker so where the watchdog is handed the handle.
    """

    backend: LockService
    name: str
    token: int
    ttl: float
    lost_reason: str | None
    acquired_at: float
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
        get_watchdog().renewer(self.alias).add(cast("Renewable", self), due)

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
                get_watchdog().schedule(cast("Renewable", self), delay)
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
            get_watchdog().renewer(self.alias).judge_by(cast("Renewable", self), end)
        elif self._renew_enabled:
            get_watchdog().schedule(cast("Renewable", self), delay)

    def _set_expires(self, end: float) -> None:
        """Under the mutex."""
        self._expires = end
        if self._forgotten is not None:
            self._expiry_cell[0] = end

    # --- the end of the lease here: lost, released or detached, and its signals --------

    def lost_on_server(self, reason: str) -> None:
        """Mark the lease lost now: the lock service said it no longer holds it."""
        self._mark_lost(reason)

    def _mark_lost(self, reason: str) -> None:
        with self._mutex:
            if self._state != HELD:
                return
            self._state = LOST
            self.lost_reason = reason
        get_watchdog().cancel(cast("Renewable", self))
        self._remembered()
        self._send_lost()

    def _remembered(self) -> None:
        """The lease ended (or moved) through this handle: nothing to end when it is freed."""
        if self._forgotten is not None:
            self._forgotten.detach()

    def _send_ended(self, signal: Signal) -> None:
        """``lock_released`` or ``lock_detached``: the lease is no longer held here.

        Queued, not sent, on the renewal thread (a release after a rollback):
        see ``dispatch.py``.
        """
        held_for = time.monotonic() - self.acquired_at
        get_dispatcher().deliver(
            self.alias,
            self,
            "lock_released" if signal is lock_released else "lock_detached",
            functools.partial(
                signal.send,
                sender=type(self.backend),
                backend=self.alias,
                name=self.name,
                token=self.token,
                held=self,
                held_for=held_for,
            ),
        )

    def _send_lost(self) -> None:
        logger.warning(
            "Lock %r (token %s) on backend %r was lost: %s",
            self.name,
            self.token,
            self.alias,
            self.lost_reason,
        )
        # The state changed already; on the watchdog or a renewal thread the
        # receivers run later, on the alias's signal thread (dispatch.py).
        get_dispatcher().deliver(
            self.alias,
            self,
            "lock_lost",
            functools.partial(
                send_robust,
                lock_lost,
                "lock_lost",
                sender=type(self.backend),
                backend=self.alias,
                name=self.name,
                token=self.token,
                held=self,
                reason=self.lost_reason,
                held_for=time.monotonic() - self.acquired_at,
            ),
        )
