"""Model-based tests of the backend contract: random sequences against a reference model.

A Hypothesis state machine drives one backend with random sequences of
acquire (timeout 0 and a short wait), release, extend, ensure, detach, adopt,
release_ticket, break_lock (with and without a fencing token) and list, by a
few owners on a few names, and sleeps that let short leases run out. After
every step it compares the backend with a model of the contract:

- at most one live holder per name, and it is the one the model says;
- fencing tokens strictly increase per name and are never issued twice,
  across release, break, expiry and adoption (which keeps its token);
- release, extend, ensure and release_ticket succeed only for the current
  owner, each failing the way the API documents (``LockNotOwned`` or False);
- a ticket is adopted at most once; ``break_lock(name, token=)`` with a
  token that is not the current lease's breaks nothing;
- ``list(prefix)`` is the model's live set: names, tokens and holders.

Leases that may run out are timed with ``time.monotonic()`` around each
call. A lease asked for ``ttl`` seconds is certainly held until ``ttl - EARLY``
after the call was sent, and certainly gone ``ttl + expiry_slack + MARGIN``
after it returned; between the two the model accepts either answer, and an
answer that shows the lease gone (a refused release, a granted acquire, an
absent listing) settles it. Handles whose expiry is modelled never renew
(``renew=False``); renewed handles live until released, broken or detached.
On Redlock a lease that a majority no longer holds may still refuse others
for a while (see ``LockModel.remnants``).

The machine runs once per backend of the conformance suite, against the same
real servers (``backend_alias``). ``HYPOTHESIS_PROFILE=long`` (``make
model-long``) runs it for hours; the default "ci" profile keeps the whole
file around a minute. Hypothesis prints a failure as the sequence of steps
that produced it; docs/development.md says how to replay it.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.stateful import (
    run_state_machine_as_test,
)

from django_dlock import locks
from django_dlock.testing.lease_model import CI_SLEEP, LONG_TTL, MARGIN, SHORT_TTL, LockModel

settings.register_profile(
    "ci",
    max_examples=10,
    stateful_step_count=30,
    deadline=None,
    database=None,
    print_blob=False,
    # Shrinking replays the sleeps: one failure at a time.
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=1_000_000,
    stateful_step_count=60,
    deadline=None,
    database=None,
    print_blob=False,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


@pytest.fixture(autouse=True, scope="module")
def hypothesis_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hypothesis keeps a cache (and would keep examples) under ./.hypothesis: not in the tree."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    set_hypothesis_home_dir(None)


def test_backend_follows_the_model(backend_alias: str) -> None:
    profile = settings.get_profile(PROFILE)
    if PROFILE == "ci":
        backend = locks[backend_alias]
        short_ttl = max(SHORT_TTL, backend.min_ttl)
        slept = short_ttl / 2 + short_ttl + backend.expiry_slack + MARGIN  # at most, per example
        examples = max(3, min(profile.max_examples, round(CI_SLEEP / slept)))
        profile = settings(profile, max_examples=examples)
    # A class attribute, not a subclass per backend: a failure prints its steps
    # as "state = LockModel()", "state.acquire_short(...)", which run as they are.
    LockModel.alias = backend_alias
    try:
        run_state_machine_as_test(LockModel, settings=profile)
    finally:
        LockModel.alias = "locmem"


def test_a_lease_is_listed_as_long_as_it_refuses_others(backend_alias: str) -> None:
    """Until ``list()`` leaves a lease out, nobody else may acquire it; then anybody may.

    Found by the model on Redis: LIST dropped a lease in its last millisecond
    (PTTL 0, yet live: Redis expires a key once the clock is past its end), so
    list() showed the lock free while acquire(timeout=0) still timed out. The
    listing is polled until the lease drops out, which lands in that last
    millisecond often; the rounds make missing it unlikely.
    """
    backend = locks[backend_alias]
    if getattr(backend, "redlock", False):
        pytest.skip(
            "Redlock lists what a majority of masters holds, and refuses a new holder "
            "until a majority grants it (docs/backends/redis.md): between the masters' "
            "expiries a lease is neither listed nor free"
        )
    ttl = max(0.05, backend.min_ttl)
    rounds = 10 if ttl < 0.1 else 1
    prefix = f"model:{uuid.uuid4().hex[:8]}:"
    backend.list(prefix)  # connect first: a grant that outlives a short TTL is retried
    for i in range(rounds):
        name = f"{prefix}{i}"
        # Not timeout=0: on a loaded machine a reply can come after a 50 ms
        # lease ran out, and such a grant is refused and tried again.
        held = backend.acquire(name, ttl=ttl, timeout=5, renew=False)
        deadline = time.monotonic() + ttl + backend.expiry_slack + 5
        while any(info.name == name for info in backend.list(name)):
            assert time.monotonic() < deadline, f"{name!r} is still listed long after its TTL"
        again = backend.acquire(name, ttl=LONG_TTL, timeout=0, renew=False)
        assert again.token > held.token
        again.release()
