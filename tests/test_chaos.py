"""The chaos run's history checker (chaos/history.py) catches each kind of violation.

The run itself is ``make chaos`` (CI runs ``--short``); these tests feed the
checker histories with a known flaw and check that it names it, and clean
histories that it passes.
"""

from __future__ import annotations

from typing import Any

from chaos import history, run


def acquire(w: int, inv: float, cmp: float, token: int) -> list[dict[str, Any]]:
    return [
        {"w": w, "op": "acquire", "inv": inv},
        {"w": w, "op": "acquire", "inv": inv, "cmp": cmp, "ok": True, "token": token},
    ]


def release(w: int, inv: float, cmp: float, token: int, ok: bool = True) -> list[dict[str, Any]]:
    return [
        {"w": w, "op": "release", "inv": inv, "token": token},
        {"w": w, "op": "release", "inv": inv, "cmp": cmp, "token": token, "ok": ok},
    ]


def clean_history() -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    t = 0.0
    for i, w in enumerate([0, 1, 2, 0, 1]):
        events += acquire(w, t, t + 0.01, 100 + i)
        events += release(w, t + 0.1, t + 0.11, 100 + i)
        t += 0.2
    return events


def phase(**kwargs: Any) -> history.Phase:
    return history.Phase("test", 0.0, 10.0, **kwargs)


def test_a_clean_history_passes() -> None:
    events = clean_history()
    holds = history.holds(events)
    assert [h.token for h in holds] == [100, 101, 102, 103, 104]
    result = history.check_phase(phase(), events, holds, liveness_bound=5)
    assert result.violations == []
    assert result.acquisitions == 5
    assert history.check_tokens(events) == []
    assert history.check_register([(100, 1), (101, 2), (103, 3)]) == []


def test_overlapping_holders_are_a_violation_unless_a_holder_was_paused() -> None:
    events = acquire(0, 0.0, 0.01, 1) + acquire(1, 0.02, 0.05, 2)
    events += release(0, 0.1, 0.11, 1) + release(1, 0.2, 0.21, 2)
    holds = history.holds(events)
    result = history.check_phase(phase(), events, holds, liveness_bound=5)
    assert result.overlaps == 1
    assert any("holds overlap" in v for v in result.violations)
    paused = history.check_phase(phase(pauses=True), events, holds, liveness_bound=5)
    assert paused.overlaps == 1 and paused.violations == []
    data_lost = history.check_phase(phase(exclusive=False), events, holds, liveness_bound=5)
    assert data_lost.violations == []


def test_a_token_issued_twice_or_out_of_order_is_a_violation() -> None:
    events = acquire(0, 0.0, 0.01, 5) + release(0, 0.1, 0.11, 5)
    events += acquire(1, 0.2, 0.21, 5)
    assert any("issued twice" in p for _, p in history.check_tokens(events))
    events = acquire(0, 0.0, 0.01, 5) + release(0, 0.1, 0.11, 5)
    events += acquire(1, 0.2, 0.21, 4)
    assert any("not above token 5" in p for _, p in history.check_tokens(events))
    # Concurrent attempts may be granted in either order.
    events = acquire(0, 0.0, 0.3, 5) + acquire(1, 0.1, 0.2, 4)
    assert history.check_tokens(events) == []


def test_a_lost_update_or_a_stale_fenced_write_is_a_violation() -> None:
    lost = history.check_register([(1, 1), (2, 2), (3, 2)])
    assert [t for t, _ in lost] == [3] and "lost update" in lost[0][1]
    stale = history.check_register([(1, 1), (3, 2), (2, 3)])
    assert [t for t, _ in stale] == [2] and "accepted after token 3" in stale[0][1]


def test_liveness_after_a_heal() -> None:
    events = acquire(0, 0.0, 0.01, 1) + release(0, 0.1, 0.11, 1)
    events += acquire(1, 0.2, 8.0, 2) + release(1, 8.1, 8.11, 2)
    holds = history.holds(events)
    slow = history.check_phase(
        history.Phase("f", 0.0, 10.0, episodes=[(0.5, 1.0)]), events, holds, liveness_bound=3
    )
    assert any(v.startswith("liveness") for v in slow.violations)
    quick = history.check_phase(
        history.Phase("f", 0.0, 10.0, episodes=[(0.5, 6.0)]), events, holds, liveness_bound=3
    )
    assert quick.violations == []


def test_a_killed_holder_leaves_the_lock_unavailable_until_the_next_acquisition() -> None:
    events = acquire(0, 0.0, 0.01, 1)  # then SIGKILL: no release
    events += acquire(1, 0.02, 2.01, 2) + release(1, 2.1, 2.11, 2)
    holds = history.holds(events)
    assert abs(history.longest_gap(holds, 0.0, 2.2) - 2.0) < 1e-9


def test_the_short_plan_covers_every_fault_and_every_backend() -> None:
    cells = run.plan(list(run.TARGETS), None, short=True, net_ok=True)
    assert {t for t, _ in cells} == set(run.TARGETS)
    assert sorted(f for _, fs in cells for f in fs) == sorted(run.FAULTS)
    assert all(f in run.TARGETS[t].faults for t, fs in cells for f in fs)
    full = run.plan(list(run.TARGETS), None, short=False, net_ok=False)
    assert not any(f in run.NETWORK for _, fs in full for f in fs)


def test_a_release_held_up_by_the_network_counts_as_unavailable() -> None:
    events = acquire(0, 0.0, 0.01, 1) + release(0, 0.1, 3.0, 1)  # the reply came late
    events += acquire(1, 0.05, 3.01, 2) + release(1, 3.1, 3.11, 2)
    holds = history.holds(events)
    assert abs(history.longest_gap(holds, 0.0, 3.2) - 2.91) < 1e-9


def test_a_pause_that_never_comes_back_fails_liveness() -> None:
    """A hold from before the fault that spans the heal shows nothing came back."""
    events = acquire(0, 0.0, 0.01, 1) + release(0, 5.0, 5.01, 1)  # paused, released late
    holds = history.holds(events)
    result = history.check_phase(
        history.Phase("pause", 0.0, 20.0, episodes=[(0.1, 3.0)], pauses=True),
        events,
        holds,
        liveness_bound=5,
    )
    assert any(v.startswith("liveness") for v in result.violations)


def test_a_refused_write_by_a_holder_whose_lease_was_valid_is_a_violation() -> None:
    events = acquire(0, 0.0, 0.01, 1)
    events += [{"w": 0, "op": "write", "inv": 0.1, "cmp": 0.11, "token": 1, "ok": False}]
    events += release(0, 0.2, 0.21, 1, ok=False)
    phase = history.Phase("kill", 0.0, 10.0)
    result = history.check_phase(phase, events, history.holds(events), liveness_bound=5)
    assert any("refused" in v for v in result.violations)
    # Its lease had ended by its own clock (the watchdog found it lost): fencing at work.
    events.insert(2, {"w": 0, "op": "lost", "inv": 0.09, "token": 1, "until": 0.08})
    result = history.check_phase(phase, events, history.holds(events), liveness_bound=5)
    assert result.violations == []
    assert history.holds(events)[0].end == 0.08
    # Under a pause it is what fencing is for.
    paused = history.Phase("pause", 0.0, 10.0, pauses=True)
    events = [e for e in events if e["op"] != "lost"]
    assert (
        history.check_phase(paused, events, history.holds(events), liveness_bound=5).violations
        == []
    )


def test_a_lost_signal_recorded_after_the_release_still_ends_the_hold() -> None:
    """The full chaos run counted 15 overlaps under ``pause`` on Redis that were not.

    A paused holder resumed, found its lease lost at ``ensure()`` and at its
    release, and only then did its ``lock_lost`` receiver (on the signal
    thread) record when the lease had ended by its clock: the hold was
    counted up to the release, over the next holders.
    """
    events = acquire(0, 0.0, 0.01, 1) + acquire(1, 2.5, 2.6, 2) + release(1, 2.7, 2.71, 2)
    events += release(0, 3.0, 3.01, 1, ok=False)
    events += [{"w": 0, "op": "lost", "inv": 3.02, "token": 1, "until": 2.0}]
    holds = history.holds(events)
    assert [h.end for h in holds] == [2.0, 2.7]
    assert history.check_phase(phase(), events, holds, liveness_bound=5).overlaps == 0
