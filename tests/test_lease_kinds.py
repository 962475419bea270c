"""One way into a lease (django_dlock.testing) on every backend of CONFORMANCE_BACKENDS."""

import asyncio

import pytest

from django_dlock import locks
from django_dlock.backends.limits import RW_LIMIT
from django_dlock.testing.test_lease_kinds import *  # noqa: F403


@pytest.mark.parametrize("alias", ["locmem", "redis"])
def test_options_that_name_no_lease_are_refused_before_any_io(
    alias: str, redis_servers: object
) -> None:
    """A weight without a limit, a template that is not a str, a read/write
    lock's weight that is neither a reader's nor a writer's: errors, not a
    mutex that ignores the weight or a label that breaks metrics."""
    backend = locks[alias]
    with pytest.raises(ValueError, match="needs a limit"):
        backend.acquire("kinds:w", weight=2)
    with pytest.raises(TypeError, match="template must be a str"):
        backend.acquire("kinds:t", template=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reader.*writer"):
        backend.acquire("kinds:rw", limit=RW_LIMIT, weight=2)
    with pytest.raises(TypeError, match="template must be a str"):
        asyncio.run(backend.aacquire("kinds:t", template=b"x"))  # type: ignore[arg-type]
    assert backend.get("kinds:w") is None and backend.semaphore("kinds:rw") is None
