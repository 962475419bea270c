"""The conformance suite: every backend must pass every test here, against a real server.

Each test takes ``backend_alias`` and runs once per backend in
``CONFORMANCE_BACKENDS`` (plugin.py). Sleeps wait for leases to expire by the
service's clock; they only ever bound behaviour from one side (something must
have happened by now), never measure speed.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from django_dlock import (
    DLockError,
    HeldLock,
    LockLost,
    LockNotOwned,
    LockTimeout,
    lock,
    locks,
)
from django_dlock.backends.base import BaseLockBackend
from django_dlock.signals import (
    lock_acquired,
    lock_broken,
    lock_detached,
    lock_lost,
    lock_released,
    lock_timeout,
)


def test_acquire_and_release(backend_alias: str, backend: BaseLockBackend, name: str) -> None:
    with lock(name, backend=backend_alias) as held:
        assert isinstance(held, HeldLock)
        assert held.name == name
        assert isinstance(held.token, int)
        assert [info.name for info in backend.list(name)] == [name]
    assert backend.list(name) == []
    with lock(name, backend=backend_alias, timeout=0) as again:
        assert again.token > held.token


def test_timeout_zero_tries_once(backend_alias: str, name: str) -> None:
    with lock(name, backend=backend_alias), pytest.raises(LockTimeout) as excinfo:
        lock(name, backend=backend_alias, timeout=0).acquire()
    assert isinstance(excinfo.value, DLockError)
    assert excinfo.value.name == name
    assert excinfo.value.backend == backend_alias


def test_blocking_timeout_waits_then_raises(backend_alias: str, name: str) -> None:
    with lock(name, backend=backend_alias):
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            lock(name, backend=backend_alias, timeout=0.3).acquire()
        assert time.monotonic() - started >= 0.3


def test_waiter_acquires_after_release(backend_alias: str, name: str) -> None:
    holder = lock(name, backend=backend_alias).acquire()
    waiting = threading.Event()
    got: list[HeldLock] = []

    def waiter() -> None:
        waiting.set()
        with lock(name, backend=backend_alias, timeout=30) as held:
            got.append(held)

    thread = threading.Thread(target=waiter)
    thread.start()
    waiting.wait(5)
    time.sleep(0.2)
    assert got == [], "the waiter acquired while the lock was held"
    holder.release()
    thread.join(30)
    assert len(got) == 1
    assert got[0].token > holder.token


def test_timeout_none_waits_until_release(backend_alias: str, name: str) -> None:
    holder = lock(name, backend=backend_alias).acquire()
    got: list[int] = []
    thread = threading.Thread(
        target=lambda: got.append(lock(name, backend=backend_alias).acquire().token)
    )
    thread.start()
    time.sleep(0.3)
    assert got == []
    holder.release()
    thread.join(30)
    assert got and got[0] > holder.token
    locks[backend_alias].break_lock(name)


def test_release_by_non_owner_fails(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    with lock(name, backend=backend_alias) as held:
        assert backend.do_release(name, "not-the-owner") is False
        assert backend.do_extend(name, "not-the-owner", 10) is False
        held.ensure()
        with pytest.raises(LockTimeout):
            lock(name, backend=backend_alias, timeout=0).acquire()


def test_stale_holder_cannot_release_new_holders_lock(
    backend_alias: str, name: str, short_ttl: float, past_expiry: float
) -> None:
    stale = lock(name, backend=backend_alias, ttl=short_ttl, renew=False).acquire()
    time.sleep(past_expiry)
    with lock(name, backend=backend_alias, timeout=0) as current:
        with pytest.raises(LockNotOwned):
            stale.release()
        current.ensure()
        with pytest.raises(LockTimeout):
            lock(name, backend=backend_alias, timeout=0).acquire()
    assert current.token > stale.token


def test_lease_expires_after_ttl(
    backend_alias: str, backend: BaseLockBackend, name: str, short_ttl: float, past_expiry: float
) -> None:
    held = lock(name, backend=backend_alias, ttl=short_ttl, renew=False).acquire()
    time.sleep(past_expiry)
    assert backend.list(name) == []
    assert held.lost
    with pytest.raises(LockLost):
        held.ensure()
    with lock(name, backend=backend_alias, timeout=0) as successor:
        assert successor.token > held.token


def test_extend(backend_alias: str, name: str, short_ttl: float, past_expiry: float) -> None:
    held = lock(name, backend=backend_alias, ttl=short_ttl, renew=False).acquire()
    held.extend(10)
    time.sleep(past_expiry)
    held.ensure()
    with pytest.raises(LockTimeout):
        lock(name, backend=backend_alias, timeout=0).acquire()
    assert held.ttl == 10
    held.release()


def test_extend_after_expiry_raises(
    backend_alias: str, name: str, short_ttl: float, past_expiry: float
) -> None:
    held = lock(name, backend=backend_alias, ttl=short_ttl, renew=False).acquire()
    time.sleep(past_expiry)
    with pytest.raises(LockNotOwned):
        held.extend(10)


def test_lock_lost_after_break_underneath(
    backend_alias: str, backend: BaseLockBackend, name: str, short_ttl: float
) -> None:
    lost = threading.Event()
    seen: list[dict[str, Any]] = []

    def on_lost(sender: Any, **kwargs: Any) -> None:
        if kwargs["name"] == name:
            seen.append(kwargs)
            lost.set()

    lock_lost.connect(on_lost)
    try:
        held = lock(name, backend=backend_alias, ttl=short_ttl).acquire()
        assert backend.break_lock(name) is True
        assert lost.wait(10), "the watchdog did not report the broken lease"
    finally:
        lock_lost.disconnect(on_lost)
    assert held.lost
    with pytest.raises(LockLost):
        held.ensure()
    assert seen[0]["token"] == held.token
    assert seen[0]["backend"] == backend_alias
    with pytest.raises(LockNotOwned):
        held.release()


def test_ensure_asks_the_service(backend_alias: str, backend: BaseLockBackend, name: str) -> None:
    held = lock(name, backend=backend_alias).acquire()
    backend.break_lock(name)
    # No waiting for the watchdog: ensure() itself must see the lease is gone.
    with pytest.raises(LockLost):
        held.ensure()


def test_with_block_reports_a_lease_lost_inside_it(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    with pytest.raises(LockLost), lock(name, backend=backend_alias):
        backend.break_lock(name)


def test_with_block_keeps_the_bodys_exception(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    with pytest.raises(KeyError), lock(name, backend=backend_alias):
        backend.break_lock(name)
        raise KeyError("the body's error")


def test_list_by_prefix(backend_alias: str, backend: BaseLockBackend, name: str) -> None:
    with (
        lock(f"{name}:p:a", backend=backend_alias, metadata={"note": "nightly"}),
        lock(f"{name}:p:b", backend=backend_alias),
        lock(f"{name}:q:c", backend=backend_alias) as held_c,
    ):
        assert [i.name for i in backend.list(f"{name}:p:")] == [f"{name}:p:a", f"{name}:p:b"]
        listed = {i.name: i for i in backend.list(name)}
        assert sorted(listed) == [f"{name}:p:a", f"{name}:p:b", f"{name}:q:c"]
        assert {i.name for i in backend.list()} >= set(listed)
        info = listed[f"{name}:q:c"]
        assert info.token == held_c.token
        assert info.backend == backend_alias
        assert info.holder["pid"] > 0
        assert info.holder["host"]
        assert info.holder["thread"] == threading.current_thread().name
        assert info.holder["ttl"] == 30
        assert info.acquired_at.tzinfo is not None
        assert info.expires_at - info.acquired_at <= timedelta(seconds=30.01)
        assert 0 < info.expires_in <= 30
        assert listed[f"{name}:p:a"].holder["note"] == "nightly"
    assert backend.list(name) == []


def test_get_gives_the_listed_lease_of_one_name(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    assert backend.get(name) is None
    with lock(name, backend=backend_alias, metadata={"note": "nightly"}) as held:
        info = backend.get(name)
        [listed] = backend.list(name)
        assert info is not None
        assert (info.name, info.token, info.holder) == (listed.name, listed.token, listed.holder)
        assert (info.name, info.token, info.backend) == (name, held.token, backend_alias)
        assert info.holder["note"] == "nightly"
        assert 0 < info.expires_in <= 30
    assert backend.get(name) is None


def test_get_matches_the_exact_name_not_a_prefix(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    with lock(f"{name}:b", backend=backend_alias):
        assert backend.get(name) is None
        assert backend.get(f"{name}:") is None
        info = backend.get(f"{name}:b")
        assert info is not None and info.name == f"{name}:b"


def test_get_of_an_expired_lease_is_none(
    backend_alias: str, backend: BaseLockBackend, name: str, short_ttl: float, past_expiry: float
) -> None:
    held = lock(name, backend=backend_alias, ttl=short_ttl, renew=False).acquire()
    assert backend.get(name) is not None
    time.sleep(past_expiry)
    assert backend.get(name) is None
    assert held.lost


@pytest.mark.parametrize(
    ("bad", "what"),
    [("a\x00b", "NUL"), ("x\ud800y", "surrogate")],
    ids=["nul", "surrogate"],
)
def test_get_refuses_bad_names_as_list_does(
    backend: BaseLockBackend, name: str, bad: str, what: str
) -> None:
    odd = f"{name}:{bad}"
    with pytest.raises(ValueError, match=what):
        backend.list(odd)
    with pytest.raises(ValueError, match=what):
        backend.get(odd)
    with pytest.raises(TypeError):
        backend.get(None)  # type: ignore[arg-type]


def test_break(backend_alias: str, backend: BaseLockBackend, name: str) -> None:
    broken: list[str] = []

    def on_broken(sender: Any, **kwargs: Any) -> None:
        broken.append(kwargs["name"])

    lock_broken.connect(on_broken)
    try:
        assert backend.break_lock(name) is False
        held = lock(name, backend=backend_alias).acquire()
        assert backend.break_lock(name) is True
        assert backend.break_lock(name) is False
    finally:
        lock_broken.disconnect(on_broken)
    assert broken == [name]
    with lock(name, backend=backend_alias, timeout=0) as successor:
        assert successor.token > held.token


def test_break_with_a_token_breaks_only_that_lease(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    tokens: list[int | None] = []

    def on_broken(sender: Any, **kwargs: Any) -> None:
        if kwargs["name"] == name:
            tokens.append(kwargs["token"])

    first = lock(name, backend=backend_alias).acquire()
    first.release()
    second = lock(name, backend=backend_alias).acquire()
    lock_broken.connect(on_broken)
    try:
        # The lease an operator saw has been released and the lock taken again.
        assert backend.break_lock(name, token=first.token) is False
        assert backend.break_lock(name, token=second.token + 1) is False
        second.ensure()
        assert backend.break_lock(name, token=second.token) is True
    finally:
        lock_broken.disconnect(on_broken)
    assert tokens == [second.token]
    with pytest.raises(LockLost):
        second.ensure()
    assert backend.break_lock(name, token=second.token) is False


@pytest.mark.parametrize("token", ["7", 7.0, True])
def test_break_refuses_a_token_that_is_not_an_int(
    backend: BaseLockBackend, name: str, token: Any
) -> None:
    with pytest.raises(TypeError, match="token must be an int"):
        backend.break_lock(name, token=token)


def test_ping_reports_the_server_and_its_version(
    backend_alias: str, backend: BaseLockBackend, ping_expected: tuple[str, tuple[str, ...]]
) -> None:
    """``ping_expected``: the version's pattern and the warnings' text (the plugin's fixture)."""
    version, warnings = ping_expected
    status = backend.ping()
    assert status.backend == backend_alias
    assert re.search(version, status.version), status.version
    assert status.latency >= 0
    assert len(status.warnings) == len(warnings), status.warnings
    for warning, expected in zip(status.warnings, warnings, strict=True):
        assert expected in warning


def test_tokens_strictly_increase(
    backend_alias: str, backend: BaseLockBackend, name: str, short_ttl: float, past_expiry: float
) -> None:
    tokens = []
    for _ in range(10):
        with lock(name, backend=backend_alias, timeout=0) as held:
            tokens.append(held.token)
    held = lock(name, backend=backend_alias).acquire()
    tokens.append(held.token)
    backend.break_lock(name)
    expiring = lock(name, backend=backend_alias, ttl=short_ttl, renew=False, timeout=0).acquire()
    tokens.append(expiring.token)
    time.sleep(past_expiry)
    with lock(name, backend=backend_alias, timeout=0) as held:
        tokens.append(held.token)
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens


def test_tokens_increase_per_name_when_names_interleave(backend_alias: str, name: str) -> None:
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for suffix in "abba" * 3:
        with lock(f"{name}:{suffix}", backend=backend_alias, timeout=0) as held:
            seen[suffix].append(held.token)
    for tokens in seen.values():
        assert all(x < y for x, y in itertools.pairwise(tokens)), tokens


@pytest.mark.parametrize(
    "odd",
    ["*", "?", "[ab]", "%", "_", "x%_y*?[]", "\\", "'; DROP TABLE x; --", "ключ:🔒:名前"],
)
def test_odd_names(backend_alias: str, backend: BaseLockBackend, name: str, odd: str) -> None:
    odd_name = f"{name}:{odd}"
    with lock(odd_name, backend=backend_alias) as held:
        [info] = backend.list(odd_name)
        assert info.name == odd_name
        assert info.token == held.token
        with pytest.raises(LockTimeout):
            lock(odd_name, backend=backend_alias, timeout=0).acquire()
    assert backend.list(odd_name) == []


def test_wildcards_in_prefix_match_literally(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    with lock(f"{name}:a%_b", backend=backend_alias), lock(f"{name}:axyb", backend=backend_alias):
        assert [i.name for i in backend.list(f"{name}:a%_")] == [f"{name}:a%_b"]
        assert [i.name for i in backend.list(f"{name}:a*")] == []
        assert [i.name for i in backend.list(f"{name}:a?")] == []


def test_names_are_case_sensitive(backend_alias: str, backend: BaseLockBackend, name: str) -> None:
    with lock(f"{name}:Case", backend=backend_alias):
        with lock(f"{name}:case", backend=backend_alias, timeout=0):
            assert [i.name for i in backend.list(f"{name}:C")] == [f"{name}:Case"]


def test_ten_kilobyte_names(backend_alias: str, backend: BaseLockBackend, name: str) -> None:
    long_a = f"{name}:" + "a" * 10_240
    long_b = long_a[:-1] + "b"
    with lock(long_a, backend=backend_alias) as held:
        with lock(long_b, backend=backend_alias, timeout=0):
            listed = backend.list(long_a)
            assert [i.name for i in listed] == [long_a]
            assert listed[0].token == held.token
        with pytest.raises(LockTimeout):
            lock(long_a, backend=backend_alias, timeout=0).acquire()


def test_signals(backend_alias: str, name: str) -> None:
    events: list[tuple[str, str, int | None]] = []

    def on(kind: str) -> Any:
        def receiver(sender: Any, **kwargs: Any) -> None:
            if kwargs["name"] == name:
                assert kwargs["backend"] == backend_alias
                events.append((kind, kwargs["name"], kwargs["token"]))

        return receiver

    acquired, released = on("acquired"), on("released")
    lock_acquired.connect(acquired)
    lock_released.connect(released)
    try:
        with lock(name, backend=backend_alias) as held:
            pass
    finally:
        lock_acquired.disconnect(acquired)
        lock_released.disconnect(released)
    assert events == [("acquired", name, held.token), ("released", name, held.token)]


def test_signals_describe_waits_timeouts_and_holds(backend_alias: str, name: str) -> None:
    """A timeout, a contended grant, a release and a hand-over, with their timings."""
    events: list[tuple[str, dict[str, Any]]] = []

    def on(kind: str) -> Any:
        def receiver(sender: Any, **kwargs: Any) -> None:
            if kwargs["name"] == name:
                events.append((kind, kwargs))

        return receiver

    receivers = {
        s: on(kind)
        for s, kind in [
            (lock_acquired, "acquired"),
            (lock_released, "released"),
            (lock_timeout, "timeout"),
            (lock_detached, "detached"),
        ]
    }
    for signal, receiver in receivers.items():
        signal.connect(receiver)
    try:
        holder = lock(name, backend=backend_alias).acquire()
        with pytest.raises(LockTimeout):
            lock(name, backend=backend_alias, timeout=0.2).acquire()
        threading.Timer(0.3, holder.release).start()
        with lock(name, backend=backend_alias, timeout=10) as held:
            time.sleep(0.05)
        again = lock(name, backend=backend_alias).acquire()
        locks[backend_alias].release_ticket(again.detach())
    finally:
        for signal, receiver in receivers.items():
            signal.disconnect(receiver)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for kind, kwargs in events:
        by_kind.setdefault(kind, []).append(kwargs)
    # The holder's lock_released and the waiter's lock_acquired come from two
    # threads (a fair lock hands over before its holder's release returns).
    assert {k: len(v) for k, v in by_kind.items()} == {
        "acquired": 3, "released": 2, "timeout": 1, "detached": 1
    }  # fmt: skip
    first, granted, _ = by_kind["acquired"]
    (released,) = [kw for kw in by_kind["released"] if kw["token"] == held.token]
    (timeout,), (detached,) = by_kind["timeout"], by_kind["detached"]
    assert first["contended"] is False and first["waited"] < 5
    assert timeout["waited"] >= 0.2 and timeout["template"] is None
    assert granted["contended"] is True and granted["waited"] >= 0.25
    assert granted["held"] is held and held.template is None
    assert released["token"] == held.token and released["held_for"] >= 0.05
    assert detached["token"] == again.token and detached["held_for"] >= 0


def test_release_twice_is_a_no_op_and_ensure_after_release_raises(
    backend_alias: str, name: str
) -> None:
    held = lock(name, backend=backend_alias).acquire()
    held.release()
    held.release()
    assert held.released
    with pytest.raises(LockLost):
        held.ensure()
    with pytest.raises(LockNotOwned):
        held.extend()


def test_threads_exclude_each_other(backend_alias: str, name: str) -> None:
    inside = 0
    overlaps = 0
    counter = 0
    guard = threading.Lock()

    def worker() -> None:
        nonlocal inside, overlaps, counter
        for _ in range(15):
            with lock(name, backend=backend_alias, timeout=60):
                with guard:
                    inside += 1
                    overlaps += inside > 1
                value = counter
                time.sleep(0.001)
                counter = value + 1
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert overlaps == 0
    assert counter == 60


def test_decorator_templates_key_from_arguments(
    backend_alias: str, backend: BaseLockBackend, name: str
) -> None:
    seen: list[list[str]] = []

    @lock(name + ":invoice:{invoice_id}", backend=backend_alias, timeout=0)
    def regenerate(invoice_id: int, force: bool = False) -> int:
        seen.append([i.name for i in backend.list(name)])
        return invoice_id * 2

    assert regenerate(7) == 14
    assert regenerate(invoice_id=8, force=True) == 16
    assert seen == [[f"{name}:invoice:7"], [f"{name}:invoice:8"]]
    with lock(f"{name}:invoice:7", backend=backend_alias):
        with pytest.raises(LockTimeout):
            regenerate(7)
        assert regenerate(9) == 18
