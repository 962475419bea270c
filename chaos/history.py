"""The history checker: what the workers did, and what the register kept, against the guarantees.

Input: the workers' history lines (``chaos/worker.py``), the register's log of
accepted writes in commit order, and the phases of the run (one fault each,
with the times it was injected and healed). Checked:

- **fenced writes**: the accepted writes carry strictly increasing tokens and
  consecutive values 1, 2, 3, ...: none was lost, none applied twice;
- **tokens**: no token is issued twice, and a token granted after another
  acquisition completed is larger than that one's (real-time order);
- **mutual exclusion**: no two holds overlap, where a hold runs from its
  acquisition's completion to its release's invocation. Checked only in
  phases whose fault neither pauses a holder (SIGSTOP: it cannot know) nor
  loses the lock service's data; elsewhere overlaps are counted, and the
  fenced writes must still hold;
- **liveness**: after each heal, some worker acquires within ``ttl +
  slack`` seconds.

It also measures, per phase, the longest time no worker held the lock while
workers were trying to take it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Hold:
    worker: int
    token: int
    start: float  # the acquisition's completion
    end: float  # its release's invocation, or the worker's last word while holding
    released: float | None = None  # the release's completion, if it released the lease
    #: The handle found its lease lost: it ended here by the handle's clock.
    cut: float | None = None


@dataclass
class Phase:
    fault: str
    start: float
    end: float
    #: (injected, healed) times of each episode of the fault.
    episodes: list[tuple[float, float]] = field(default_factory=list)
    #: A holder can be paused past its lease: it cannot know it lost it.
    pauses: bool = False
    #: Mutual exclusion is promised under this fault (not: the service lost its data).
    exclusive: bool = True


@dataclass
class PhaseResult:
    fault: str
    operations: int = 0
    acquisitions: int = 0
    writes_accepted: int = 0
    writes_refused: int = 0
    overlaps: int = 0
    longest_unavailable: float = 0.0
    violations: list[str] = field(default_factory=list)


def holds(events: Iterable[dict[str, Any]]) -> list[Hold]:
    """Each acquisition that completed, with when its holder stopped claiming to hold it."""
    out: list[Hold] = []
    current: dict[int, Hold] = {}
    # The lost signal is recorded by its receiver, on the package's signal
    # thread: possibly after the holder's own release. It still says when the
    # lease ended by the handle's clock.
    cuts = {
        (e["w"], e.get("token")): e.get("until", e["inv"]) for e in events if e["op"] == "lost"
    }
    for e in sorted(events, key=lambda e: (e["w"], e.get("cmp", e["inv"]))):
        w = e["w"]
        t = e.get("cmp", e["inv"])
        hold = current.get(w)
        if e["op"] == "acquire" and e.get("ok") is True:
            hold = Hold(w, e["token"], e["cmp"], e["cmp"], cut=cuts.get((w, e["token"])))
            current[w] = hold
            out.append(hold)
        elif hold is not None and e.get("token") == hold.token:
            if e["op"] == "lost":
                pass  # taken from ``cuts`` at the acquisition
            elif e["op"] == "release" and "cmp" not in e:
                hold.end = e["inv"]
            elif e["op"] == "release":
                if e.get("ok") is True:
                    hold.released = e["cmp"]
                del current[w]
            elif hold.end == hold.start or hold.end < t:
                hold.end = max(hold.end, t)
        elif hold is not None and e["op"] in ("start", "acquire"):
            # The worker started over (it was killed and respawned) or moved on.
            del current[w]
    for h in out:
        if h.cut is not None:
            h.end = max(h.start, min(h.end, h.cut))
    return sorted(out, key=lambda h: h.start)


def check_register(rows: list[tuple[int, int]]) -> list[tuple[int, str]]:
    """The accepted writes ``(token, value)`` in commit order: (token, problem) pairs."""
    problems = []
    last_token, last_value = None, 0
    for token, value in rows:
        if value != last_value + 1:
            what = "lost update" if value <= last_value else "gap"
            problems.append((token, f"{what}: value {value} after {last_value} (token {token})"))
        if last_token is not None and token <= last_token:
            problems.append(
                (token, f"fenced write with token {token} accepted after token {last_token}")
            )
        last_token, last_value = token, value
    return problems


def check_tokens(events: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """No token twice; an acquisition that began after another completed has a larger token."""
    granted = [e for e in events if e["op"] == "acquire" and e.get("ok") is True]
    problems = []
    seen: dict[int, dict[str, Any]] = {}
    for e in granted:
        if e["token"] in seen:
            problems.append(
                (e["cmp"], f"token {e['token']} issued twice "
                 f"(workers {seen[e['token']]['w']} and {e['w']})")
            )  # fmt: skip
        seen[e["token"]] = e
    by_completion = sorted(granted, key=lambda e: e["cmp"])
    completions = [e["cmp"] for e in by_completion]
    # The largest token among acquisitions completed before each index.
    running, best = [], None
    for e in by_completion:
        best = e if best is None or e["token"] > best["token"] else best
        running.append(best)
    for e in granted:
        i = bisect.bisect_left(completions, e["inv"])
        if i and running[i - 1]["token"] >= e["token"]:
            before = running[i - 1]
            problems.append(
                (e["cmp"], f"token {e['token']} (worker {e['w']}) not above token "
                 f"{before['token']} granted before it was asked for (worker {before['w']})")
            )  # fmt: skip
    return problems


def overlaps(hs: list[Hold]) -> list[tuple[Hold, Hold]]:
    """Pairs of holds by different workers that overlap in time."""
    found = []
    ordered = sorted(hs, key=lambda h: h.start)
    latest: Hold | None = None
    for h in ordered:
        if latest is not None and h.start < latest.end and h.worker != latest.worker:
            found.append((latest, h))
        if latest is None or h.end > latest.end:
            latest = h
    return found


def longest_gap(hs: list[Hold], start: float, end: float) -> float:
    """The longest stretch of [start, end] in which nobody used the lock nor could take it.

    A hold that ended in a release covers the time from its acquisition until
    the holder let go (the release's invocation: a release held up by the
    network keeps the others out, but the holder no longer uses the lock). A
    holder that never released (killed, paused past its lease, cut off)
    covers only its acquisition. What is not covered until the next
    acquisition is the time the lock was unavailable to the others.
    """
    spans = sorted((h.start, h.end if h.released else h.start) for h in hs if h.start < end)
    longest, covered = 0.0, start
    for s, e in spans:
        if s > covered:
            longest = max(longest, min(s, end) - covered)
        covered = max(covered, e)
        if covered >= end:
            break
    if covered < end:
        longest = max(longest, end - covered)
    return longest


def check_phase(
    phase: Phase,
    events: list[dict[str, Any]],
    hs: list[Hold],
    *,
    liveness_bound: float,
) -> PhaseResult:
    """One fault's share of the run (the run adds the register's and tokens' findings)."""
    result = PhaseResult(phase.fault)
    inside = [e for e in events if "cmp" in e and phase.start <= e["cmp"] < phase.end]
    result.operations = len(inside)
    result.acquisitions = sum(1 for e in inside if e["op"] == "acquire" and e.get("ok") is True)
    writes = [e for e in inside if e["op"] == "write"]
    result.writes_accepted = sum(1 for e in writes if e.get("ok") is True)
    result.writes_refused = sum(1 for e in writes if e.get("ok") is False)
    mine = [h for h in hs if phase.start <= h.start < phase.end]
    pairs = overlaps([h for h in hs if h.start < phase.end and h.end > phase.start])
    pairs = [(a, b) for a, b in pairs if phase.start <= b.start < phase.end]
    result.overlaps = len(pairs)
    if pairs and phase.exclusive and not phase.pauses:
        for a, b in pairs[:5]:
            result.violations.append(
                f"holds overlap: worker {a.worker} token {a.token} [{a.start:.3f}, {a.end:.3f}] "
                f"and worker {b.worker} token {b.token} from {b.start:.3f}"
            )
    if phase.exclusive and not phase.pauses:
        # A refused write is fencing at work when the writer's lease had ended
        # by its own clock (lost under a partition, say). When it had not, a
        # newer token was issued while this holder still held the lock.
        by_token = {h.token: h for h in hs}
        for e in writes:
            if e.get("ok") is not False:
                continue
            h = by_token.get(e["token"])
            if h is None or h.cut is None or h.cut > e["cmp"]:
                result.violations.append(
                    f"fenced write with token {e['token']} (worker {e['w']}) refused at "
                    f"{e['cmp']:.3f} while its lease was held: a newer token was issued"
                )
    result.longest_unavailable = longest_gap(mine + [h for h in hs if h.start < phase.start],
                                             phase.start, phase.end)  # fmt: skip
    starts = sorted(h.start for h in hs)
    for injected, healed in phase.episodes:
        i = bisect.bisect_left(starts, healed)
        # Held at the heal by someone who took it during the fault: that
        # counts. A hold from before the fault (a paused holder, a release
        # held up by a partition) does not: it shows nothing came back.
        held_through = any(injected <= h.start <= healed < (h.released or h.end) for h in hs)
        if held_through:
            continue
        late = i == len(starts) or starts[i] > healed + liveness_bound
        if late and healed + liveness_bound <= phase.end:
            nxt = "never" if i == len(starts) else f"after {starts[i] - healed:.2f}s"
            result.violations.append(
                f"liveness: not acquired within {liveness_bound:g}s of the heal at "
                f"{healed:.3f} ({nxt})"
            )
    return result
