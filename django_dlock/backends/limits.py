"""The limits of semaphores and read/write locks: a leaf module, imported by the handle too."""

from __future__ import annotations

#: The limit of a read/write lock: a reader weighs 1, a writer all of it.
RW_LIMIT = 2**31 - 1
#: The largest ``limit`` a semaphore may have.
MAX_LIMIT = 1_000_000


def describe_limit(limit: int) -> str:
    """How a message names the semaphore of ``limit``."""
    return "a read/write lock" if limit == RW_LIMIT else f"a semaphore of limit {limit}"


def validate_limit(limit: object) -> int:
    """``limit``, if it is an int from 1 to MAX_LIMIT; else ``TypeError``/``ValueError``."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, not {type(limit).__name__}.")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}.")
    return limit
