"""A forward step of the lock service's clock is seen, and its leases checked (issue 28).

The step itself is played on a scripted server with a virtual clock (a real
Redis or PostgreSQL clock cannot be stepped here without stepping the whole
machine's); the reads of the clock and the probe's schedule are checked
against the real servers.
"""

from __future__ import annotations

import time

import pytest

from django_dlock import clocks as clocks_module
from django_dlock import lock, locks
from django_dlock.clocks import PROBE_EVERY, SLACK, ClockProbe, ClockWatch
from django_dlock.watchdog import get_watchdog
from tests.test_lease_simulation import Clock as VirtualTime


class ScriptedServer:
    """Leases that end on the server's wall clock, which may step; calls take ``rtt``."""

    tells_server_time = True

    def __init__(self, clock: VirtualTime, rtt: float = 0.002) -> None:
        self.clock = clock
        self.offset = 1_790_000_000.0 - clock.now  # server wall = local monotonic + offset
        self.rtt = rtt
        self.ends: dict[str, float] = {}  # owner -> end, server wall clock

    @property
    def wall(self) -> float:
        return self.clock.now + self.offset

    def do_server_time(self) -> float:
        self.clock.now += self.rtt / 2
        read = self.wall
        self.clock.now += self.rtt / 2
        return read

    def do_check(self, name: str, owner: str) -> bool:
        return self.ends.get(owner, 0.0) > self.wall


class ScriptedOps:
    """The lease kind (a mutex) on the scripted server: what the probe checks through."""

    def __init__(self, server: ScriptedServer) -> None:
        self.server = server

    def check(self, name: str, owner: str) -> bool:
        return self.server.do_check(name, owner)


class Handle:
    def __init__(self, server: ScriptedServer, owner: str, ttl: float) -> None:
        self.backend, self.name, self.owner = server, f"lock-{owner}", owner
        self.ops = ScriptedOps(server)
        server.ends[owner] = server.wall + ttl
        self.lost: str | None = None
        self.lost_at = 0.0

    def lost_on_server(self, reason: str) -> None:
        self.lost, self.lost_at = reason, self.backend.clock.now


def test_a_forward_step_marks_the_leases_the_server_let_go_lost_within_a_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 28 item 7: a +45 s step ended a 30 s lease at once, unseen by the handle.

    The probe's loop runs on a virtual clock: ten quiet seconds, then the
    server's clock steps 45 s forward, then five more seconds.
    """
    clock = VirtualTime()
    monkeypatch.setattr(clocks_module, "time", clock)
    server = ScriptedServer(clock)
    short, long_ = Handle(server, "short", ttl=30), Handle(server, "long", ttl=300)
    start = clock.now
    stepped_at = start + 10.5
    renewed: list[Handle] = []

    def sleep(seconds: float) -> None:
        before, clock.now = clock.now, clock.now + seconds
        if before < stepped_at <= clock.now:
            server.offset += 45  # the server's clock steps 45 s forward

    def scheduled() -> list[Handle]:
        if clock.now > start + 16:
            return []  # the leases are released: the probe stops
        return [h for h in (short, long_) if h.lost is None]

    probe = ClockProbe("scripted", scheduled, renewed.append, sleep=sleep, spawn=lambda f, n: f())
    probe.start(server)  # runs the loop here, to its end
    assert not probe.running
    assert len(probe.steps) == 1 and abs(probe.steps[0] - 45) < 0.1
    assert short.lost is not None and "stepped 45.0 s forward" in short.lost
    assert short.lost_at - stepped_at <= PROBE_EVERY + 0.01  # lost within one probe
    assert long_.lost is None and renewed == [long_]  # still held: renewed at once


@pytest.mark.parametrize(
    ("step", "rtt", "seen"),
    [
        (0.3, 0.002, False),  # under the slack
        (SLACK + 0.2, 0.002, True),
        (SLACK + 0.2, 0.5, False),  # within what a slow round trip leaves unknown
        (-60.0, 0.002, False),  # backwards: leases last longer, nothing to check
    ],
)
def test_what_counts_as_a_step(step: float, rtt: float, seen: bool) -> None:
    watch = ClockWatch()
    assert watch.observe(5000.0, 10.0, 10.0 + rtt) == 0.0
    found = watch.observe(5000.0 + 1.0 + step, 11.0, 11.0 + rtt)
    assert (found > 0) is seen


def test_a_drifting_clock_is_not_a_step() -> None:
    """NTP slews: 500 ppm (its limit) over an hour of probes is never reported."""
    watch = ClockWatch()
    for second in range(3600):
        local = 10.0 + second * PROBE_EVERY
        assert watch.observe(5000.0 + second * PROBE_EVERY * 1.0005, local, local + 0.002) == 0.0


@pytest.mark.backends("redis", "db-sqlite", "db-postgresql", "db-mysql")
@pytest.mark.with_default_db
def test_the_servers_clock_is_read_and_probed_while_leases_are_held(
    backend_alias: str, name: str
) -> None:
    """On the real servers: the clock read is the wall clock, and no step is seen."""
    backend = locks[backend_alias]
    assert backend.tells_server_time
    assert abs(backend.do_server_time() - time.time()) < 2
    probe = get_watchdog().renewer(backend_alias).clock
    with lock(name, backend=backend_alias, ttl=1.5):
        time.sleep(3)  # renewals start the probe, which reads the clock every second
        assert probe.running
    assert probe.steps == []
    deadline = time.monotonic() + 5
    while probe.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not probe.running  # no lease left: it stops


@pytest.mark.backends("redis-cluster", "redlock", "etcd", "locmem")
def test_backends_with_no_one_clock_are_not_probed(backend_alias: str) -> None:
    assert not getattr(locks[backend_alias], "tells_server_time", False)
