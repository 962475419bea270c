"""Settings for benchmarks/async_waiters.py: listing_settings' Redis backend, fair and unfair."""

from benchmarks.listing_settings import *  # noqa: F403
from benchmarks.listing_settings import DLOCK_BACKENDS as _LISTING

DLOCK_BACKENDS = {
    "default": {**_LISTING["default"], "OPTIONS": {"fair": True}},
    "unfair": _LISTING["default"],
}
DLOCK_BACKENDS["fair"] = DLOCK_BACKENDS["default"]
