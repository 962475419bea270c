"""The reference model of a lock service, as a Hypothesis state machine (``LockModel``).

test_model.py runs it against each backend under test; its module docstring
says what the model checks and how it times leases.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from django_dlock import HeldLock, LockLost, LockNotOwned, LockTimeout, locks
from django_dlock.backends.base import BaseLockBackend

#: A lease that must run out during an example asks for this (or the backend's shortest).
SHORT_TTL = 0.2
#: A lease that must outlive every example asks for this.
LONG_TTL = 30.0
#: How late, beyond its TTL and the backend's ``expiry_slack``, a lease may
#: still be seen on a loaded machine (scheduling, the call's own round trip).
MARGIN = 0.2
#: How early a lease may end by our clock: services count in whole
#: milliseconds of their own clock (Redis truncates the time it sets PX from).
EARLY = 0.01
#: The "ci" profile's examples of one backend sleep about this long in all:
#: backends whose leases run out slowly (etcd) run fewer of them.
CI_SLEEP = 6.0

OWNERS = st.sampled_from(["A", "B", "C"])
# "a" is a prefix of "ab"; the third has characters that LIKE, glob and key
# layouts treat specially.
SUFFIXES = ["a", "ab", "ö */%_[x]"]
NAMES = st.sampled_from(SUFFIXES)
PREFIXES = st.sampled_from(["", "a", "ab", "ö */%", "_", "ö */%_[x]", "b"])
KINDS = st.sampled_from(["short", "long", "renewed"])
TIMEOUTS = st.sampled_from([0, 0.05])

HELD, RELEASED, DETACHED, LOST = "held", "released", "detached", "lost"
LIVE, GONE, UNKNOWN = "live", "gone", "unknown"
INF = float("inf")


@dataclass
class Lease:
    """The model of the live lease on one name."""

    token: int
    owner: str  # the owner token of the handle or ticket that holds it
    label: str  # the acquirer's "owner" metadata, which list() shows
    live_until: float  # monotonic: certainly held before this...
    gone_after: float  # ...and certainly gone after this
    renewed: bool  # a watchdog renews it: held until released, broken or detached

    def status(self, t0: float, t1: float) -> str:
        """Was it held throughout a call made between ``t0`` and ``t1``?"""
        if self.renewed or t1 < self.live_until:
            return LIVE
        if t0 > self.gone_after:
            return GONE
        return UNKNOWN


@dataclass(eq=False)
class Handle:
    """What one acquire or adopt gave (``held`` is None if it was refused), and its model.

    Refused attempts go into the bundle too, as no-ops: what a step draws must
    not depend on how an earlier step's race with the clock turned out, or
    Hypothesis could not replay a failure.
    """

    held: HeldLock | None
    owner: str = ""  # who acquired or adopted it (A, B, C)
    state: str = HELD
    ttl: float = 0.0
    renew: bool = False
    trusted_until: float = 0.0  # ensure() trusts its own clock, without asking, until then


@dataclass(eq=False)
class Ticket:
    """What one detach gave: the ticket, or None if it was refused."""

    ticket: dict[str, Any] | None


class LockModel(RuleBasedStateMachine):
    """The contract of ``BaseLockBackend`` as a state machine; ``alias`` is set per backend."""

    alias = "locmem"
    handles = Bundle("handles")
    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.backend: BaseLockBackend = locks[self.alias]
        self.prefix = f"model:{uuid.uuid4().hex[:8]}:"
        self.short_ttl = max(SHORT_TTL, self.backend.min_ttl)
        self.leases: dict[str, Lease] = {}
        # Redlock lists what a majority of its masters holds and grants what a
        # majority grants (docs/backends/redis.md). A lease that a majority no
        # longer holds may live on on a minority (the masters' keys were set
        # moments apart, or a refused extend or adopt reached one master):
        # neither listed nor free until then. name -> (token, gone by).
        self.majority = bool(getattr(self.backend, "redlock", False))
        self.remnants: dict[str, tuple[int, float]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.granted_handles: list[Handle] = []
        self.issued: list[dict[str, Any]] = []
        self.slept = 0.0

    # --- helpers ------------------------------------------------------------------

    def full(self, suffix: str) -> str:
        return self.prefix + suffix

    def lease_of(self, name: str, owner: str) -> Lease | None:
        lease = self.leases.get(name)
        return lease if lease is not None and lease.owner == owner else None

    def new_token(self, name: str, token: int) -> None:
        """A new acquisition: its token must be larger than any this name had."""
        issued = self.tokens.setdefault(name, [])
        assert not issued or token > issued[-1], (
            f"token {token} for {name!r} does not exceed the earlier {issued}"
        )
        issued.append(token)

    def timed(self, lease: Lease, t0: float, t1: float, ttl: float, renew: bool) -> None:
        """The lease was (re)granted for ``ttl`` by a call sent at t0 that returned at t1."""
        lease.live_until = t0 + ttl - EARLY
        lease.gone_after = INF if renew else t1 + ttl + self.backend.expiry_slack + MARGIN
        lease.renewed = renew

    def trust(self, ttl: float, t0: float, renew: bool) -> float:
        """Until when a handle granted ``ttl`` by a call sent at t0 trusts its own clock."""
        return INF if renew else t0 + ttl - self.backend.drift(ttl)

    def settle(self, name: str, lease: Lease, t1: float) -> None:
        """The lease is gone: an answer showed it (not a release or break that deleted it)."""
        if self.leases.get(name) is lease:
            del self.leases[name]
        until = lease.gone_after if lease.gone_after < INF else t1
        self.remnant(name, lease.token, until, 0.0, t1)

    def remnant(self, name: str, token: int, until: float, ttl: float, t1: float) -> None:
        """On Redlock, a minority may hold ``token`` until ``until`` or ``ttl`` after t1."""
        if not self.majority:
            return
        until = max(until, t1 + ttl + MARGIN, self.remnants.get(name, (0, 0.0))[1])
        self.remnants[name] = (token, until)

    def remnant_of(self, name: str, t0: float) -> int | None:
        """The token a minority of Redlock masters may still hold at t0, if any."""
        token, until = self.remnants.get(name, (0, 0.0))
        return token if t0 <= until else None

    def handle(self, held: HeldLock, owner: str, ttl: float, renew: bool, t0: float) -> Handle:
        handle = Handle(held, owner, HELD, ttl, renew, self.trust(ttl, t0, renew))
        self.granted_handles.append(handle)
        return handle

    # --- acquisition --------------------------------------------------------------

    @initialize(target=handles, owner=OWNERS, suffix=NAMES, kind=KINDS)
    def start_holding(self, owner: str, suffix: str, kind: str) -> Handle:
        return self.acquire(owner, suffix, kind, 0)

    # One rule per kind, so that acquiring is drawn as often as the rest.

    @rule(target=handles, owner=OWNERS, suffix=NAMES, timeout=TIMEOUTS)
    def acquire_short(self, owner: str, suffix: str, timeout: float) -> Handle:
        """A lease that runs out during the example (never renewed)."""
        return self.acquire(owner, suffix, "short", timeout)

    @rule(target=handles, owner=OWNERS, suffix=NAMES, timeout=TIMEOUTS)
    def acquire_long(self, owner: str, suffix: str, timeout: float) -> Handle:
        """A lease that outlives the example (never renewed)."""
        return self.acquire(owner, suffix, "long", timeout)

    @rule(target=handles, owner=OWNERS, suffix=NAMES, timeout=TIMEOUTS)
    def acquire_renewed(self, owner: str, suffix: str, timeout: float) -> Handle:
        """A lease that the watchdog renews."""
        return self.acquire(owner, suffix, "renewed", timeout)

    def acquire(self, owner: str, suffix: str, kind: str, timeout: float) -> Handle:
        name = self.full(suffix)
        ttl = self.short_ttl if kind == "short" else LONG_TTL
        renew = kind == "renewed"
        lease = self.leases.get(name)
        t0 = time.monotonic()
        try:
            held = self.backend.acquire(
                name, ttl=ttl, timeout=timeout, metadata={"owner": owner}, renew=renew
            )
        except LockTimeout:
            held = None
        t1 = time.monotonic()
        status = GONE if lease is None else lease.status(t0, t1)
        if held is None:
            # A grant whose reply came after its lease ran out is refused
            # (test_late_grant.py): on a loaded machine, with a short TTL.
            late = t1 - t0 >= ttl
            assert status != GONE or late or self.remnant_of(name, t0) is not None, (
                f"{name!r} was free, yet acquire(timeout={timeout}) timed out"
            )
            return Handle(None)
        assert status != LIVE, f"{name!r} was granted to {owner} while {lease} held it"
        assert (held.name, held.ttl) == (name, ttl)
        self.new_token(name, held.token)
        lease = Lease(held.token, held.owner, owner, 0.0, 0.0, False)
        self.timed(lease, t0, t1, ttl, renew)
        self.leases[name] = lease
        return self.handle(held, owner, ttl, renew, t0)

    @rule(target=handles, got=tickets, owner=OWNERS, longer=st.booleans(), renew=st.booleans())
    def adopt(self, got: Ticket, owner: str, longer: bool, renew: bool) -> Handle:
        """Adopt a ticket for the TTL it was held with, or for 30 s."""
        ticket = got.ticket
        if ticket is None:
            return Handle(None)
        name = ticket["name"]
        ttl = LONG_TTL if longer else ticket["ttl"]
        renew = renew and ttl == LONG_TTL  # a renewed short lease is not modelled
        lease = self.lease_of(name, ticket["owner"])
        t0 = time.monotonic()
        try:
            adopted = self.backend.adopt(ticket, ttl=LONG_TTL if longer else None, renew=renew)
        except LockNotOwned:
            adopted = None
        t1 = time.monotonic()
        status = GONE if lease is None else lease.status(t0, t1)
        if adopted is None:
            assert status != LIVE, f"adopting the ticket of {lease} was refused"
            if lease is not None:
                self.settle(name, lease, t1)  # it ran out
            # The refused move may have reached one master (Redlock).
            self.remnant(name, ticket["token"], 0.0, ttl, t1)
            return Handle(None)
        assert lease is not None and status != GONE, (
            f"adopted a ticket for token {ticket['token']} of {name!r}, which the model "
            f"has as {self.leases.get(name)}"
        )
        assert adopted.token == ticket["token"] == lease.token, "adoption changed the token"
        assert (adopted.name, adopted.ttl) == (name, ttl)
        lease.owner = adopted.owner
        self.timed(lease, t0, t1, ttl, renew)
        return self.handle(adopted, owner, ttl, renew, t0)

    # --- a handle's operations ----------------------------------------------------

    @rule(handle=handles)
    def release(self, handle: Handle) -> None:
        held = handle.held
        if held is None:
            return
        lease = self.lease_of(held.name, held.owner)
        t0 = time.monotonic()
        try:
            held.release()
            refused = False
        except LockNotOwned:
            refused = True
        t1 = time.monotonic()
        if handle.state in (RELEASED, DETACHED):
            assert not refused, f"releasing a {handle.state} handle is a no-op, it raised"
            return
        handle.state = RELEASED
        status = GONE if lease is None else lease.status(t0, t1)
        if status == LIVE:
            assert not refused, f"the owner of {lease} could not release it"
        if status == GONE:
            assert refused, (
                f"{held!r} released a lease it did not hold ({self.leases.get(held.name)})"
            )
        if lease is not None and refused:
            self.settle(held.name, lease, t1)  # found to be gone
        elif lease is not None:
            del self.leases[held.name]

    @rule(handle=handles, ttl=st.sampled_from([None, "short", "long"]))
    def extend(self, handle: Handle, ttl: str | None) -> None:
        """Extend by the handle's TTL, a short one or 30 s."""
        held = handle.held
        if held is None:
            return
        if ttl == "short" and handle.renew:
            ttl = None  # the watchdog would renew every short/3 s: not modelled
        seconds = {None: None, "short": self.short_ttl, "long": LONG_TTL}[ttl]
        lease = self.lease_of(held.name, held.owner)
        t0 = time.monotonic()
        try:
            held.extend(seconds)
            refused = False
        except LockNotOwned:
            refused = True
        t1 = time.monotonic()
        if handle.state != HELD:
            assert refused, f"a {handle.state} handle was extended"
            return
        status = GONE if lease is None else lease.status(t0, t1)
        if status == LIVE:
            assert not refused, f"the owner of {lease} could not extend it"
        if status == GONE:
            assert refused, f"{held!r} extended a lease it did not hold"
        if refused:
            handle.state = LOST
            if lease is not None:
                self.settle(held.name, lease, t1)
            # The refused extend may have reached one master (Redlock).
            self.remnant(held.name, held.token, 0.0, seconds or handle.ttl, t1)
            return
        assert lease is not None
        new_ttl = handle.ttl if seconds is None else seconds
        assert held.ttl == new_ttl
        handle.ttl = new_ttl
        handle.trusted_until = self.trust(new_ttl, t0, handle.renew)
        self.timed(lease, t0, t1, new_ttl, handle.renew)

    @rule(handle=handles)
    def ensure(self, handle: Handle) -> None:
        held = handle.held
        if held is None:
            return
        lease = self.lease_of(held.name, held.owner)
        t0 = time.monotonic()
        try:
            held.ensure()
            lost = False
        except LockLost:
            lost = True
        t1 = time.monotonic()
        if handle.state != HELD:
            assert lost, f"ensure() passed on a {handle.state} handle"
            return
        status = GONE if lease is None else lease.status(t0, t1)
        # Past its own estimate of the lease's end, ensure() raises without asking.
        trusted = t1 < handle.trusted_until
        if status == LIVE and trusted:
            assert not lost, f"ensure() failed for the owner of {lease}"
        if status == GONE:
            assert lost, f"ensure() passed for {held!r}, whose lease is gone"
        if lost:
            handle.state = LOST
            if lease is not None and trusted:
                self.settle(held.name, lease, t1)  # the service said so: the lease is gone

    @rule(target=tickets, handle=handles)
    def detach(self, handle: Handle) -> Ticket:
        held = handle.held
        if held is None:
            return Ticket(None)
        lease = self.lease_of(held.name, held.owner)
        t0 = time.monotonic()
        try:
            ticket = held.detach()
        except LockNotOwned:
            ticket = None
        t1 = time.monotonic()
        if handle.state != HELD:
            assert ticket is None, f"a {handle.state} handle was detached"
            return Ticket(None)
        status = GONE if lease is None else lease.status(t0, t1)
        if ticket is None:
            # Where detaching asks the service (etcd moves a session lease's
            # key), or the watchdog found a renewed lease gone, a handle whose
            # lease is gone is refused; elsewhere it gets a ticket adopt refuses.
            assert status != LIVE, f"the owner of {lease} could not detach it"
            if lease is not None:
                self.settle(held.name, lease, t1)
            return Ticket(None)
        handle.state = DETACHED
        assert (ticket["name"], ticket["token"], ticket["owner"]) == (
            held.name,
            held.token,
            held.owner,
        )
        if lease is not None and lease.renewed:
            # No longer renewed: it runs out a TTL after its last renewal,
            # which came after the last known grant and before this call.
            lease.renewed = False
            lease.gone_after = t1 + handle.ttl + self.backend.expiry_slack + MARGIN
        self.issued.append(ticket)
        return Ticket(ticket)

    @rule(got=tickets)
    def release_ticket(self, got: Ticket) -> None:
        ticket = got.ticket
        if ticket is None:
            return
        name = ticket["name"]
        lease = self.lease_of(name, ticket["owner"])
        t0 = time.monotonic()
        released = self.backend.release_ticket(ticket)
        t1 = time.monotonic()
        status = GONE if lease is None else lease.status(t0, t1)
        if status == LIVE:
            assert released, f"release_ticket() of {lease} was refused"
        if status == GONE:
            assert not released, (
                f"release_ticket() of token {ticket['token']} released {self.leases.get(name)}"
            )
        if lease is not None and not released:
            self.settle(name, lease, t1)
        elif lease is not None:
            del self.leases[name]

    # --- the operator's side ------------------------------------------------------

    @rule(suffix=NAMES)
    def break_lock(self, suffix: str) -> None:
        name = self.full(suffix)
        lease = self.leases.get(name)
        t0 = time.monotonic()
        broken = self.backend.break_lock(name)
        t1 = time.monotonic()
        status = GONE if lease is None else lease.status(t0, t1)
        if status == LIVE:
            assert broken, f"break_lock() left {lease}"
        if status == GONE:
            assert not broken or self.remnant_of(name, t0) is not None, (
                "break_lock() broke a lock the model has free"
            )
        if lease is not None and not broken:
            self.settle(name, lease, t1)
        self.leases.pop(name, None)
        if broken:
            self.remnants.pop(name, None)  # deleted on every master that had it

    @rule(suffix=NAMES, which=st.sampled_from(["current", "earlier", "next"]))
    def break_lock_with_token(self, suffix: str, which: str) -> None:
        """Break with the current lease's token, an earlier one, or one not issued yet."""
        name = self.full(suffix)
        lease = self.leases.get(name)
        issued = self.tokens.get(name, [])
        last = issued[-1] if issued else 1
        if which == "current":
            token = lease.token if lease is not None else last
        elif which == "earlier":
            earlier = [t for t in issued if lease is None or t != lease.token]
            token = earlier[-1] if earlier else last - 1
        else:
            token = last + 1
        meant = lease is not None and token == lease.token
        t0 = time.monotonic()
        broken = self.backend.break_lock(name, token=token)
        t1 = time.monotonic()
        if not meant:
            assert not broken or token == self.remnant_of(name, t0), (
                f"break_lock(token={token}) broke {lease} (tokens {issued})"
            )
            if broken:
                self.remnants.pop(name, None)
            return
        assert lease is not None
        status = lease.status(t0, t1)
        if status == LIVE:
            assert broken, f"break_lock(token={token}) left {lease}"
        if status == GONE:
            assert not broken, "break_lock() broke a lease the model has run out"
        if broken:
            del self.leases[name]
            self.remnants.pop(name, None)
        else:
            self.settle(name, lease, t1)

    @rule(prefix=PREFIXES)
    def list_prefix(self, prefix: str) -> None:
        self.compare_listing(self.prefix + prefix)

    @rule()
    def confirm_holders(self) -> None:
        """Ask the service about every handle: at most one owner per name, the model's."""
        confirmed: dict[str, list[HeldLock]] = {}
        for handle in self.granted_handles:
            held = handle.held
            if held is None or handle.state == DETACHED:
                continue  # a detached handle's lease is the ticket's now
            lease = self.lease_of(held.name, held.owner)
            t0 = time.monotonic()
            owns = self.backend.do_check(held.name, held.owner)
            t1 = time.monotonic()
            status = GONE if lease is None else lease.status(t0, t1)
            if status == LIVE:
                assert owns, f"the service does not confirm the owner of {lease}"
            if status == GONE:
                assert not owns, f"the service confirms {held!r}, which does not hold the lock"
            if owns:
                confirmed.setdefault(held.name, []).append(held)
            elif lease is not None:
                self.settle(held.name, lease, t1)
        for name, owners in confirmed.items():
            assert len(owners) == 1, f"{name!r} is held by {owners}"

    # --- time ---------------------------------------------------------------------

    @property
    def past_expiry(self) -> float:
        """How long until a short lease taken just now has certainly run out."""
        return self.short_ttl + self.backend.expiry_slack + MARGIN

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        time.sleep(seconds)

    # The preconditions count what this example slept, never the clock, so that
    # Hypothesis draws the same rules when it replays a failure.

    @precondition(lambda self: self.slept < self.short_ttl / 2)
    @rule()
    def sleep_into_short_leases(self) -> None:
        """Half a short TTL: for a while, leases taken before may or may not have run out."""
        self.sleep(self.short_ttl / 2)

    @precondition(lambda self: self.slept < self.past_expiry)
    @rule()
    def sleep_past_short_leases(self) -> None:
        """Until every short lease taken so far has certainly run out."""
        self.sleep(self.past_expiry)

    # --- checks after every step --------------------------------------------------

    @invariant()
    def listing_matches_the_model(self) -> None:
        self.compare_listing(self.prefix)

    def compare_listing(self, prefix: str) -> None:
        t0 = time.monotonic()
        listed = self.backend.list(prefix)
        t1 = time.monotonic()
        names = [info.name for info in listed]
        assert len(names) == len(set(names)), f"a name is listed twice: {listed}"
        by_name = {info.name: info for info in listed}
        for name in set(self.leases) | set(by_name):
            lease = self.leases.get(name)
            info = by_name.get(name)
            if not name.startswith(prefix):
                assert info is None, f"list({prefix!r}) listed {name!r}"
                continue
            status = GONE if lease is None else lease.status(t0, t1)
            if info is None:
                assert status != LIVE, f"list({prefix!r}) left out {lease} ({name!r})"
                if lease is not None:
                    self.settle(name, lease, t1)
                continue
            assert status != GONE, f"list({prefix!r}) shows {info}, the model has it free"
            assert lease is not None
            assert info.token == lease.token, f"listed {info}, the model has {lease}"
            assert info.holder.get("owner") == lease.label, f"listed {info}, held by {lease}"
            assert info.backend == self.alias

    def teardown(self) -> None:
        """Release what is still held and break the rest, so no lease outlives the example."""
        for handle in self.granted_handles:
            if handle.held is not None and handle.state in (HELD, LOST):
                # Refused if it had run out or been broken: nothing to release.
                with contextlib.suppress(LockLost):
                    handle.held.release()
        for ticket in self.issued:
            self.backend.release_ticket(ticket)
        for suffix in SUFFIXES:
            self.backend.break_lock(self.full(suffix))
        assert self.backend.list(self.prefix) == []
