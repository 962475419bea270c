"""The ZooKeeper backend beyond the conformance suite: kazoo's own Lock recipe on the
same nodes, both ways, in separate processes; a holder frozen past its session; a
session that expires; the ensemble losing its leader; settings.

Every test talks to real ZooKeeper servers that the tests start (tests/servers.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_dlock import LockLost, LockTimeout, lock, locks
from django_dlock.backends.zookeeper import ZooKeeperBackend
from django_dlock.backends.zookeeper.paths import escape, parse_location
from django_dlock.checks import check_backends
from django_dlock.exceptions import LockConfigurationError
from django_dlock.signals import lock_lost
from tests.servers import wait_for

ROOT = Path(__file__).resolve().parent.parent
ZK = "django_dlock.backends.zookeeper.ZooKeeperBackend"

pytestmark = pytest.mark.usefixtures("zookeeper_servers")

# A process that holds a lock through kazoo's own recipe, on our node layout.
_KAZOO_HOLDER = """
import sys
from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock
hosts, path, mode = sys.argv[1:4]
client = KazooClient(hosts=hosts, timeout=5.0)
client.start(timeout=20)
recipe = Lock(client, path, "kazoo-holder")
if mode == "hold":
    assert recipe.acquire(timeout=20)
    print("held", flush=True)
    sys.stdin.readline()
    recipe.release()
else:  # "try": refused at once while ours holds, then acquired once we release
    print("first", recipe.acquire(blocking=False), flush=True)
    print("then", recipe.acquire(timeout=20), flush=True)
    recipe.release()
client.stop()
client.close()
"""


def _kazoo(path: str, mode: str) -> subprocess.Popen[str]:
    hosts = settings.DLOCK_BACKENDS["zookeeper"]["LOCATION"]
    return subprocess.Popen(
        [sys.executable, "-c", _KAZOO_HOLDER, hosts, path, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _path(name: str) -> str:
    return f"/dlock/{escape(name)}"


@pytest.mark.multiprocess
def test_kazoos_lock_excludes_ours(name: str) -> None:
    """A lock held through kazoo's Lock recipe, in another process, refuses ours until released."""
    holder = _kazoo(_path(name), "hold")
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(LockTimeout):
            lock(name, backend="zookeeper", timeout=0.5).acquire()
        assert holder.stdin is not None
        holder.stdin.write("release\n")
        holder.stdin.flush()
        with lock(name, backend="zookeeper", timeout=10) as held:
            assert held.token > 0
    finally:
        holder.kill()
        holder.wait(timeout=20)


@pytest.mark.multiprocess
def test_ours_excludes_kazoos_lock(name: str) -> None:
    """Ours held: kazoo's Lock in another process is refused, then gets it after our release."""
    held = lock(name, backend="zookeeper").acquire()
    contender = _kazoo(_path(name), "try")
    try:
        assert contender.stdout is not None
        assert contender.stdout.readline().split() == ["first", "False"]
        time.sleep(0.5)  # it waits on our node now
        held.release()
        assert contender.stdout.readline().split() == ["then", "True"]
        assert contender.wait(timeout=20) == 0
    finally:
        contender.kill()
        contender.wait(timeout=20)


_FROZEN_HOLDER = """
import json, os, sys
import django
django.setup()
from django_dlock import lock
from django_dlock.signals import lock_lost
lost = []
lock_lost.connect(lambda sender, **kw: lost.append(kw["name"]), weak=False)
held = lock(os.environ["DLOCK_NAME"], backend="zookeeper", ttl=30).acquire()
print(json.dumps({"token": held.token}), flush=True)
for line in sys.stdin:  # "check": what the handle believes, before any call
    print(json.dumps({"lost": held.lost, "expires_in": held.expires_in}), flush=True)
    try:
        held.ensure()
        print(json.dumps({"ensure": "held"}), flush=True)
    except Exception as e:
        print(json.dumps({"ensure": type(e).__name__}), flush=True)
    import time
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"lock_lost": lost}), flush=True)
    break
"""


@pytest.mark.multiprocess
def test_a_holder_frozen_past_its_session_knows_its_lease_is_gone(name: str) -> None:
    """SIGSTOP a holder (ttl 30 s) past its 2 s session: another takes the lock; the
    resumed holder's handle says lost before it asks anything, and lock_lost fires.

    A handle that counted its TTL alone would believe it held the lock for 30 s
    while the server had let it go with its session."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{ROOT / 'testproject'}",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DLOCK_NAME": name,
    }
    holder = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        first = json.loads(holder.stdout.readline())["token"]
        os.kill(holder.pid, signal.SIGSTOP)
        started = time.monotonic()
        with lock(name, backend="zookeeper", timeout=15) as successor:
            took = time.monotonic() - started
            assert successor.token > first
            os.kill(holder.pid, signal.SIGCONT)
            holder.stdin.write("check\n")
            holder.stdin.flush()
            belief = json.loads(holder.stdout.readline())
            assert belief["lost"] is True, belief
            assert json.loads(holder.stdout.readline()) == {"ensure": "LockLost"}
            assert json.loads(holder.stdout.readline()) == {"lock_lost": [name]}
        # Within the session timeout (2 s) and a few ticks of noticing.
        assert took < 2.0 + 3.0, took
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=20)


def _expire_session(backend: ZooKeeperBackend) -> None:
    """ZooKeeper's own way to expire a session: another client with its id and password."""
    from kazoo.client import KazooClient

    twin = KazooClient(hosts=backend.hosts, client_id=backend.client.client_id)
    twin.start(timeout=10)
    twin.stop()
    twin.close()


def test_an_expired_session_marks_every_lease_on_it_lost(name: str) -> None:
    """The session ends (closed by a second client with its id): every lease on it is
    lost at once, with lock_lost, and others can take them."""

    backend = locks["zookeeper"]
    assert isinstance(backend, ZooKeeperBackend)
    lost: list[str] = []
    seen = threading.Event()

    def on_lost(sender: Any, **kw: Any) -> None:
        if kw["name"].startswith(name):
            lost.append(kw["name"])
            if len(lost) == 2:
                seen.set()

    lock_lost.connect(on_lost)
    try:
        first = lock(f"{name}:a", backend="zookeeper", ttl=30).acquire()
        second = lock(f"{name}:b", backend="zookeeper", ttl=30).acquire()
        _expire_session(backend)
        assert seen.wait(15), lost
        assert sorted(lost) == [f"{name}:a", f"{name}:b"]
        assert first.lost and second.lost
        with pytest.raises(LockLost):
            first.ensure()
        # The backend opens a new session; the locks are free.
        for suffix, old in (("a", first), ("b", second)):
            with lock(f"{name}:{suffix}", backend="zookeeper", timeout=10) as again:
                assert again.token > old.token
    finally:
        lock_lost.disconnect(on_lost)


def test_the_ensemble_keeps_locks_through_its_leaders_death(
    zookeeper_servers: dict[str, Any], name: str
) -> None:
    """Kill the leader of 3 servers while a lock is held and renewed: it stays held, a
    waiter stays excluded, and tokens keep increasing once a new leader is elected."""
    ensemble = zookeeper_servers["ensemble"]
    held = lock(name, backend="zookeeper-ensemble", ttl=3).acquire()
    [leader] = [s for s in ensemble if s.mode() == "leader"]
    leader.kill()
    try:
        time.sleep(3 * 2.0)  # three session timeouts, with renewals due every second
        held.ensure()
        with pytest.raises(LockTimeout):
            lock(name, backend="zookeeper-ensemble", timeout=0.5).acquire()
        held.release()
        with lock(name, backend="zookeeper-ensemble", timeout=10) as after:
            assert after.token > held.token
    finally:
        leader.start()
    wait_for(
        lambda: sorted(s.mode() for s in ensemble) == ["follower", "follower", "leader"],
        60,
        "the ensemble to have its three servers again",
    )


def test_names_map_to_one_path_component_each_and_prefixes_stay_prefixes() -> None:
    for name in ("a/b", ".", "..", "%2F", "ünï", "\x1fdlock:x", "a b", "z" * 300):
        component = escape(name)
        assert "/" not in component and component not in (".", "..")
        assert component.isascii() and component.isprintable()
        for cut in range(len(name)):
            assert component.startswith(escape(name[:cut]))


@pytest.mark.parametrize(
    ("location", "chroot", "hosts"),
    [
        ("127.0.0.1:2181", None, "127.0.0.1:2181"),
        (["a:1", "b:2"], None, "a:1,b:2"),
        ("zk://a:1,b:2/app/locks", None, "a:1,b:2/app/locks"),
        ("a:1,b:2/app", None, "a:1,b:2/app"),
        ("a:1", "/app/", "a:1/app"),
        ("zk://a:1/", None, "a:1"),
    ],
)
def test_location_forms(location: Any, chroot: str | None, hosts: str) -> None:
    assert parse_location(location, chroot) == hosts


@pytest.mark.parametrize(
    ("params", "mentions"),
    [
        ({"LOCATION": "redis://127.0.0.1:2181"}, "zk://"),
        ({"LOCATION": "127.0.0.1:99999"}, "host:port"),
        ({"LOCATION": "127.0.0.1:"}, "host:port"),
        ({"LOCATION": []}, "LOCATION"),
        ({"LOCATION": ["127.0.0.1:2181", 5]}, "LOCATION"),
        ({"LOCATION": "zk://a:1/app", "OPTIONS": {"chroot": "/other"}}, "twice"),
        ({"LOCATION": "a:1", "OPTIONS": {"chroot": "app"}}, "absolute"),
        ({"LOCATION": "a:1", "OPTIONS": {"session_timeout": 0}}, "session_timeout"),
        ({"LOCATION": "a:1", "OPTIONS": {"auth": [("digest",)]}}, "auth"),
        ({"LOCATION": "a:1", "OPTIONS": {"ttl": 3}}, "ttl"),
        ({"LOCATION": "a:1", "OPTIONS": {"sweep": "no"}}, "sweep"),
        ({"LOCATION": "zk://app:s3cret@127.0.0.1:2181/x"}, "OPTIONS\\['auth'\\]"),
    ],
)
def test_bad_settings_are_check_errors(params: dict[str, Any], mentions: str) -> None:
    with pytest.raises(LockConfigurationError, match=mentions):
        ZooKeeperBackend("bad", params)
    setting = {"default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}}
    setting["z"] = {"BACKEND": ZK, **params}
    with override_settings(DLOCK_BACKENDS=setting):
        errors = list(check_backends())
    assert [e.id for e in errors] in (["django_dlock.E006"], ["django_dlock.E004"]), errors
    assert "'z'" in errors[0].msg
    assert "s3cret" not in errors[0].msg


def test_a_ttl_shorter_than_the_session_is_a_warning() -> None:
    backend = ZooKeeperBackend(
        "z", {"LOCATION": "a:1", "TTL": 5, "OPTIONS": {"session_timeout": 10}}
    )
    [warning] = backend.check()
    assert warning.id == "django_dlock.W006"
    assert "10s" in warning.msg and "5s" in warning.msg
    assert ZooKeeperBackend("z", {"LOCATION": "a:1"}).check() == []


def _ghost(backend: ZooKeeperBackend, name: str, owner: str) -> str:
    """A node of ``owner``'s that its attempt never heard of: a create that landed late."""
    path: str = backend.client.create(
        f"{backend._dir(name)}/{owner}__lock__", b"{}", ephemeral=True, sequence=True,
        makepath=True,
    )  # fmt: skip
    return path


def test_an_attempt_deletes_its_own_late_landing_create(name: str) -> None:
    """Chaos run, leader fault: a create that went unanswered landed after the attempt
    had made another node; the ghost stood at the head of the queue while the
    process lived, and nobody got the lock again."""
    backend = locks["zookeeper"]
    assert isinstance(backend, ZooKeeperBackend)
    ops, attempt, _, _ = backend._begin(name, 5, None, None, True, None, 1, None)
    ghost = _ghost(backend, name, attempt.owner)
    token = attempt.try_acquire()  # its own node is behind the ghost: it must not wait on it
    assert isinstance(token, int)
    assert backend.client.exists(ghost) is None
    assert ops.release(name, attempt.owner)


def test_a_late_create_after_the_attempt_ended_is_deleted(name: str) -> None:
    """The same ghost, landing after its attempt gave up: the keepalive deletes it."""
    backend = locks["zookeeper"]
    assert isinstance(backend, ZooKeeperBackend)
    directory = backend._dir(name)
    backend._unsure_create(directory, "gone-owner")
    ghost = _ghost(backend, name, "gone-owner")
    wait_for(lambda: backend.client.exists(ghost) is None, 10, "the ghost to be deleted")
    with lock(name, backend="zookeeper", timeout=0):
        pass


def test_a_standalone_server_restarted_keeps_the_sessions_locks(name: str) -> None:
    """Stop and start a standalone server (its data on disk): the session, and the lock
    on it, survive; another client stays excluded; tokens keep increasing.

    Sessions of 8 s: the restart (a JVM's start) must take less than that."""
    from tests.servers import free_port, start_zookeeper

    ports = [(free_port(), free_port(), free_port())]
    [server] = start_zookeeper(ports, extra=("maxSessionTimeout=20000",))
    options = {"session_timeout": 8.0}
    backend = ZooKeeperBackend("zk-restart", {"LOCATION": server.endpoint, "OPTIONS": options})
    other = ZooKeeperBackend("zk-restart-2", {"LOCATION": server.endpoint, "OPTIONS": options})
    try:
        held = backend.acquire(name, ttl=30)
        server.restart()
        wait_for(lambda: not held.lost and _ensured(held), 20, "the lock to be confirmed again")
        with pytest.raises(LockTimeout):
            other.acquire(name, timeout=0.5)
        held.release()
        with other.acquire(name, timeout=10) as after:
            assert after.token > held.token
    finally:
        backend.close()
        other.close()
        server.cleanup()


def _ensured(held: Any) -> bool:
    try:
        held.ensure()
    except Exception:
        return False
    return True


def test_an_expired_session_ends_a_lease_nobody_renews_too(name: str) -> None:
    """renew=False: no lock_lost (nothing watches it), but the handle counts itself lost."""

    backend = locks["zookeeper"]
    assert isinstance(backend, ZooKeeperBackend)
    held = lock(name, backend="zookeeper", ttl=30, renew=False).acquire()
    _expire_session(backend)
    wait_for(lambda: held.lost, 10, "the handle to count its lease lost")
    with lock(name, backend="zookeeper", timeout=10) as again:
        assert again.token > held.token
        # The new session's answers say nothing of the old session's node.
        time.sleep(1.0)  # the keepalive confirms the new session meanwhile
        assert held.lost and not again.lost
    with pytest.raises(LockLost):
        held.ensure()


def _own_server() -> Any:
    from tests.servers import free_port, start_zookeeper

    [server] = start_zookeeper([(free_port(), free_port(), free_port())])
    return server


def _outcome(call: Any, limit: float) -> tuple[str, float]:
    """What ``call()`` did within ``limit`` s in a thread: ("returned"/an error name/"hung")."""
    result: list[str] = []

    def run() -> None:
        try:
            call()
            result.append("returned")
        except Exception as e:
            result.append(type(e).__name__)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    return (result[0] if result else "hung"), time.monotonic() - started


def test_calls_give_up_when_the_server_is_gone(name: str) -> None:
    """Review: with the only server dead, release, get, list and acquire blocked for good
    (kazoo's blocking calls have no limit); each now ends within its timeouts."""
    server = _own_server()
    backend = ZooKeeperBackend(
        "zk-gone", {"LOCATION": server.endpoint, "OPTIONS": {"session_timeout": 2, "timeout": 1}}
    )
    try:
        held = backend.acquire(name, ttl=30)
        server.kill()
        outcomes = {
            "acquire": _outcome(lambda: backend.acquire(f"{name}:2", timeout=2), 15),
            "release": _outcome(held.release, 15),
            "get": _outcome(lambda: backend.get(name), 15),
            "list": _outcome(lambda: backend.list(name), 15),
        }
        assert all(what != "hung" for what, _ in outcomes.values()), outcomes
        assert outcomes["get"][0] == outcomes["list"][0] == "BackendUnavailable", outcomes
        assert outcomes["acquire"][0] in ("LockTimeout", "BackendUnavailable"), outcomes
    finally:
        backend.close()
        server.cleanup()


def test_a_server_that_lost_its_data_is_locked_on_again(name: str) -> None:
    """Review: a server restarted without its data refuses the old session (it has seen
    a later zxid) for good, and kazoo offered it forever: the backend gives that
    client up once its session cannot have lived, and locks on a new one."""
    server = _own_server()
    backend = ZooKeeperBackend(
        "zk-wiped", {"LOCATION": server.endpoint, "OPTIONS": {"session_timeout": 2, "timeout": 1}}
    )
    try:
        held = backend.acquire(name, ttl=30)
        server.stop()
        import shutil

        shutil.rmtree(server.dir / "data" / "version-2", ignore_errors=True)
        server.start()
        wait_for(lambda: held.lost, 10, "the old lease to count as lost")
        again = backend.acquire(name, timeout=20)
        again.release()
    finally:
        backend.close()
        server.cleanup()


def test_a_holder_cut_off_hears_lock_lost_by_its_session_timeout(name: str) -> None:
    """Review: a holder (ttl 30) cut off from ZooKeeper counted its lease gone after its
    2 s session, but lock_lost came only with its next renewal's failure, 8 s later."""
    from tests.netproxy import Proxy

    server = _own_server()
    proxy = Proxy(server.client_port)
    backend = ZooKeeperBackend(
        "zk-cut", {"LOCATION": f"127.0.0.1:{proxy.port}", "OPTIONS": {"session_timeout": 2}}
    )
    heard: list[float] = []

    def on_lost(sender: Any, **kw: Any) -> None:
        if kw["name"] == name:
            heard.append(time.monotonic())

    lock_lost.connect(on_lost)
    try:
        held = backend.acquire(name, ttl=30)
        cut = time.monotonic()
        proxy.close()
        wait_for(lambda: bool(heard), 15, "lock_lost")
        assert heard[0] - cut < 2.0 + 1.5, heard[0] - cut
        assert held.lost
    finally:
        lock_lost.disconnect(on_lost)
        backend.close()
        proxy.close()
        server.cleanup()


@pytest.mark.parametrize("sweep", [True, False])
def test_empty_lock_directories_are_swept_unless_told_not_to(name: str, sweep: bool) -> None:
    location = settings.DLOCK_BACKENDS["zookeeper"]["LOCATION"]
    backend = ZooKeeperBackend(
        "zk-sweep", {"LOCATION": location, "OPTIONS": {"session_timeout": 2, "sweep": sweep}}
    )
    try:
        backend.acquire(name).release()
        directory = backend._dir(name)
        if sweep:
            wait_for(lambda: backend.zk.exists(directory) is None, 15, "the sweep")
        else:
            time.sleep(3 * 2.0)  # past the sweep's delay (2 s)
            assert backend.zk.exists(directory) is not None
    finally:
        backend.close()


def test_a_renewal_batch_answers_an_unreachable_service_per_lease() -> None:
    """Renewals against a service that cannot be reached: each lease gets its error (the
    watchdog retries it until the lease runs out), not one exception for the batch."""
    from tests.servers import free_port

    backend = ZooKeeperBackend(
        "zk-none", {"LOCATION": f"127.0.0.1:{free_port()}", "OPTIONS": {"timeout": 0.5}}
    )
    try:
        results = backend.do_extend_many([("a", "o1", 5.0), ("b", "o2", 5.0)])
        assert [type(r).__name__ for r in results] == ["BackendUnavailable"] * 2
    finally:
        backend.close()
