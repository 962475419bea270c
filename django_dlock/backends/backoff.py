"""The jittered, doubling sleeps between an acquisition's tries, and while a service is down."""

from __future__ import annotations

import random

#: Backoff of the default ``wait()``: first sleep, growth factor and ceiling (seconds).
BACKOFF_FIRST = 0.002
BACKOFF_FACTOR = 2.0
#: Longest sleep of the default ``wait()`` between tries, seconds.
BACKOFF_CEILING = 0.1

#: Longest sleep between retries while the lock service is down, seconds.
OUTAGE_BACKOFF_CEILING = 1.0
# More doublings than any ceiling needs (0.002 * 2**64 is about 3.7e16 s).
_MAX_DOUBLINGS = 64


def backoff(attempt: int, ceiling: float = BACKOFF_CEILING) -> float:
    """The jittered sleep before retry ``attempt`` (0, 1, ...): doubling up to ``ceiling``.

    The exponent stops growing long after any ceiling is reached: ``2.0 **
    1024`` overflows a float, which a waiter reached after about 77 s of 0.1 s
    sleeps.
    """
    ceiling = min(ceiling, BACKOFF_FIRST * BACKOFF_FACTOR ** min(attempt, _MAX_DOUBLINGS))
    return random.uniform(ceiling / 2, ceiling)


def outage_backoff(retry: int) -> float:
    """The jittered sleep before retry ``retry`` while the service is down.

    The waiting backoff, growing on to OUTAGE_BACKOFF_CEILING: many waiters
    must not reconnect ten times a second each to a server that is coming
    back up (each retry may also release its unknown attempt).
    """
    return backoff(retry, OUTAGE_BACKOFF_CEILING)
