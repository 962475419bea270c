"""Model-based tests of semaphores and read/write locks: random sequences against a model.

A Hypothesis state machine drives one backend with random sequences of
semaphore acquisitions (limit 1 or 2, ``timeout=0``), read and write
acquisitions of read/write locks, release, extend, ensure, ``break_slot``
(by token, a wrong token, or all) and ``semaphores()`` listings, by a few
holders on a few names. After every step it compares the backend with the
model of the contract:

- a name is a semaphore of one limit or a read/write lock while it has
  holders; asking for it another way raises ``LimitMismatch``;
- a semaphore has at most ``limit`` holders; a read/write lock has readers
  or one writer; ``timeout=0`` is granted exactly when the model has room;
- fencing tokens strictly increase per name across grants, releases and
  breaks, and are never issued twice;
- release, extend and ensure succeed only for a current holder;
- ``semaphores(prefix)`` lists exactly the model's holders, tokens and modes.

Leases here are long and renewed: expiry is covered by the conformance suite
(tests/test_semaphores.py). The machine runs once per backend that declares
``supports_semaphores``, against the same real servers.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from django_dlock import HeldLock, LimitMismatch, LockLost, LockNotOwned, LockTimeout, locks
from django_dlock import rwlock as make_rwlock
from django_dlock import semaphore as make_semaphore
from django_dlock.backends.limits import RW_LIMIT

settings.register_profile(
    "slots-ci",
    max_examples=8,
    stateful_step_count=30,
    deadline=None,
    database=None,
    print_blob=False,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "slots-long",
    max_examples=1_000_000,
    stateful_step_count=60,
    deadline=None,
    database=None,
    print_blob=False,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = "slots-long" if os.environ.get("HYPOTHESIS_PROFILE") == "long" else "slots-ci"

SUFFIXES = ["a", "ab", "ö */%_[x]"]
NAMES = st.sampled_from(SUFFIXES)
PREFIXES = st.sampled_from(["", "a", "ab", "ö", "b"])
#: How a holder asks: a semaphore of limit 1 or 2, or a side of a read/write lock.
KINDS = st.sampled_from(["sem1", "sem2", "read", "write"])
LIMITS = {"sem1": 1, "sem2": 2, "read": RW_LIMIT, "write": RW_LIMIT}
WEIGHTS = {"sem1": 1, "sem2": 1, "read": 1, "write": RW_LIMIT}
MODES = {"sem1": "slot", "sem2": "slot", "read": "read", "write": "write"}
LONG_TTL = 30.0


@dataclass(eq=False)
class Slot:
    name: str
    kind: str
    held: HeldLock
    live: bool = True
    #: Released by its handle (a second release is a no-op), not broken.
    released: bool = False


class SlotModel(RuleBasedStateMachine):
    alias = "locmem"

    def __init__(self) -> None:
        super().__init__()
        self.backend = locks[self.alias]
        self.prefix = f"model-slots:{uuid.uuid4().hex[:8]}:"
        self.slots: list[Slot] = []
        self.last_token: dict[str, int] = {}
        self.tokens: set[tuple[str, int]] = set()

    def full(self, suffix: str) -> str:
        return self.prefix + suffix

    def holders(self, name: str) -> list[Slot]:
        return [s for s in self.slots if s.live and s.name == name]

    def room(self, name: str, kind: str) -> str:
        """ "grant", "refuse" or "mismatch": what ``timeout=0`` must get."""
        held = self.holders(name)
        if held and LIMITS[held[0].kind] != LIMITS[kind]:
            return "mismatch"
        used = sum(WEIGHTS[s.kind] for s in held)
        return "grant" if used + WEIGHTS[kind] <= LIMITS[kind] else "refuse"

    def make(self, name: str, kind: str) -> HeldLock:
        if kind.startswith("sem"):
            return make_semaphore(
                name, limit=LIMITS[kind], backend=self.alias, ttl=LONG_TTL, timeout=0
            ).acquire_handle()
        rw = make_rwlock(name, backend=self.alias, ttl=LONG_TTL, timeout=0)
        side = rw.read() if kind == "read" else rw.write()
        return side.acquire_handle()

    @rule(suffix=NAMES, kind=KINDS)
    def acquire(self, suffix: str, kind: str) -> None:
        name = self.full(suffix)
        expected = self.room(name, kind)
        try:
            held = self.make(name, kind)
        except LimitMismatch:
            assert expected == "mismatch", f"{kind} on {suffix!r}: LimitMismatch, model {expected}"
            return
        except LockTimeout:
            assert expected == "refuse", f"{kind} on {suffix!r}: refused, model {expected}"
            return
        assert expected == "grant", f"{kind} on {suffix!r}: granted, model {expected}"
        assert (name, held.token) not in self.tokens, f"token {held.token} issued twice"
        assert held.token > self.last_token.get(name, -1), "tokens must increase per name"
        self.last_token[name] = held.token
        self.tokens.add((name, held.token))
        self.slots.append(Slot(name, kind, held))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.slots:
            return
        slot = data.draw(st.sampled_from(self.slots))
        if slot.live:
            slot.held.release()
        elif slot.released:
            slot.held.release()  # releasing twice is a no-op
        else:
            with pytest.raises(LockNotOwned):  # broken: the work was not protected to the end
                slot.held.release()
        slot.live, slot.released = False, True

    @rule(data=st.data())
    def extend_and_ensure(self, data: st.DataObject) -> None:
        if not self.slots:
            return
        slot = data.draw(st.sampled_from(self.slots))
        if slot.live:
            slot.held.extend(LONG_TTL)
            slot.held.ensure()
        else:
            with pytest.raises(LockLost):
                slot.held.ensure()
            with pytest.raises(LockLost):
                slot.held.extend(LONG_TTL)

    @rule(data=st.data(), how=st.sampled_from(["token", "wrong", "all"]))
    def break_slot(self, data: st.DataObject, how: str) -> None:
        live = [s for s in self.slots if s.live]
        if not live:
            return
        slot = data.draw(st.sampled_from(live))
        if how == "all":
            gone = self.holders(slot.name)
            assert self.backend.break_slot(slot.name) == len(gone)
        elif how == "wrong":
            wrong = max(t for n, t in self.tokens if n == slot.name) + 1000
            assert self.backend.break_slot(slot.name, token=wrong) == 0
            gone = []
        else:
            assert self.backend.break_slot(slot.name, token=slot.held.token) == 1
            gone = [slot]
        for s in gone:
            s.live = False
            with pytest.raises(LockLost):
                s.held.ensure()

    @rule(prefix=PREFIXES)
    def listing(self, prefix: str) -> None:
        full = self.prefix + prefix
        listed = {i.name: i for i in self.backend.semaphores(full)}
        for suffix in SUFFIXES:
            name = self.full(suffix)
            held = sorted(self.holders(name), key=lambda s: s.held.token)
            info = listed.pop(name, None)
            if not name.startswith(full) or not held:
                assert info is None or not info.holders, f"listed {info}, model has none"
                continue
            assert info is not None, f"semaphores({prefix!r}) left out {suffix!r}"
            assert [h.token for h in info.holders] == [s.held.token for s in held]
            assert list(info.modes) == [MODES[s.kind] for s in held]
            assert info.limit == LIMITS[held[0].kind]
            assert info.kind == ("semaphore" if held[0].kind.startswith("sem") else "rwlock")
        assert not listed, f"listed names outside the model: {sorted(listed)}"

    @invariant()
    def never_over_the_limit(self) -> None:
        for suffix in SUFFIXES:
            held = self.holders(self.full(suffix))
            if held:
                assert sum(WEIGHTS[s.kind] for s in held) <= LIMITS[held[0].kind]

    def teardown(self) -> None:
        for slot in self.slots:
            if slot.live:
                with contextlib.suppress(LockLost):
                    slot.held.release()
        for suffix in SUFFIXES:
            self.backend.break_slot(self.full(suffix))
        assert all(not i.holders for i in self.backend.semaphores(self.prefix))


def test_semaphores_follow_the_model(backend_alias: str) -> None:
    backend = locks[backend_alias]
    if not backend.supports_semaphores:
        pytest.skip(f"backend {backend_alias!r} declares no supports_semaphores")
    SlotModel.alias = backend_alias
    try:
        run_state_machine_as_test(SlotModel, settings=settings.get_profile(PROFILE))
    finally:
        SlotModel.alias = "locmem"
