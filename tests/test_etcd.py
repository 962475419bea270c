"""The etcd backend beyond the conformance suite: key layout, etcdctl interop, the
FIFO queue, leases, connections (TLS, auth, failover) and a 3-member cluster
losing a follower and then its leader while locks are held and waited for.

Every test talks to real etcd members that the tests start (tests/servers.py).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core import checks
from django.test import override_settings

from django_dlock import (
    BackendUnavailable,
    HeldLock,
    LockLost,
    LockNotOwned,
    LockTimeout,
    lock,
    locks,
    semaphore,
)
from django_dlock.backends.etcd import EtcdBackend
from django_dlock.backends.etcd.transport import (
    CREATE_DESC,
    created_at,
    delete,
    delete_txn,
    encode_op,
    get,
    put,
    queue_txn,
    txn,
)
from django_dlock.checks import check_backends
from django_dlock.exceptions import LockConfigurationError
from tests.servers import (
    EtcdServer,
    etcdctl,
    etcdctl_popen,
    free_port,
    start_etcd_cluster,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent
ETCD = "django_dlock.backends.etcd.EtcdBackend"

pytestmark = pytest.mark.skipif(
    "etcd" in settings.UNAVAILABLE_BACKENDS,
    reason=settings.UNAVAILABLE_BACKENDS.get("etcd", ""),
)


@pytest.fixture
def single(etcd_servers: dict[str, Any]) -> EtcdServer:
    server: EtcdServer = etcd_servers["single"]
    return server


def keys(endpoint: str, prefix: str) -> list[dict[str, Any]]:
    """The keys under ``prefix`` as etcdctl sees them, in create-revision order."""
    out = etcdctl(endpoint, "get", "--prefix", prefix, "-w", "json").stdout
    kvs = json.loads(out).get("kvs", [])
    for kv in kvs:
        kv["key"] = base64.b64decode(kv["key"]).decode()
        kv["value"] = base64.b64decode(kv.get("value", "")).decode()
    return sorted(kvs, key=lambda kv: kv["create_revision"])


def lease_of(endpoint: str, name: str) -> str:
    """The lease (hex) in the key of the oldest holder or waiter of ``name``."""
    return str(keys(endpoint, f"dlock/{name}/")[0]["key"].rsplit("/", 1)[1])


@pytest.fixture
def make_backend() -> Iterator[Callable[..., EtcdBackend]]:
    """``make_backend(location, alias="own", **options)``: closed after the test."""
    made: list[EtcdBackend] = []

    def make(location: str | list[str], alias: str = "own", **options: Any) -> EtcdBackend:
        made.append(EtcdBackend(alias, {"LOCATION": location, "OPTIONS": options}))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def make_server() -> Iterator[Callable[..., EtcdServer]]:
    """etcd members of the test's own (to kill, or to configure), removed at the end."""
    made: list[EtcdServer] = []

    def make(label: str, *extra: str, scheme: str = "http") -> EtcdServer:
        client, peer = free_port(), free_port()
        made.append(EtcdServer(label, client, peer, {label: peer}, *extra, scheme=scheme))
        return made[-1].start()

    yield make
    for server in made:
        server.cleanup()


def python(code: str) -> subprocess.Popen[str]:
    """Another process with Django's default settings and an etcd backend object."""
    prelude = (
        "import django\nfrom django.conf import settings\nsettings.configure()\n"
        "django.setup()\nfrom django_dlock.backends.etcd import EtcdBackend\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


# --- layout and interop ---------------------------------------------------------------


# etcd3 cannot be imported: any import of it, or of a module under it, fails.
_NO_ETCD3 = """
import sys

class NoEtcd3:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "etcd3":
            raise ImportError(f"{name}: blocked by the test")

sys.meta_path.insert(0, NoEtcd3())
"""

_USE_THE_BACKEND = """
import sys
import django
from django.conf import settings
settings.configure()
django.setup()
from django_dlock.backends.etcd import EtcdBackend
from django_dlock.exceptions import LockTimeout

endpoint, name = sys.argv[1:]
b = EtcdBackend("x", {"LOCATION": endpoint})
held = b.acquire(name, ttl=5)
try:
    b.acquire(name, ttl=5, timeout=0.5)  # queues, watches its predecessor, times out
except LockTimeout:
    pass
assert [info.token for info in b.list(name)] == [held.token]
b.ping()
held.release()
assert b.list(name) == []
b.close()
print("etcd3 loaded:", any(m.partition(".")[0] == "etcd3" for m in sys.modules))
"""


def _python_with(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_the_backend_runs_without_etcd3(single: EtcdServer, name: str) -> None:
    """The gRPC stubs are the package's own (etcdrpc/), not etcd3-fc's ``etcd3``.

    etcd3-fc is installed here for the benchmark's peer; the child process
    cannot import it, and locks, waits (a watch), lists and pings all the same.
    """
    out = _python_with(_NO_ETCD3 + _USE_THE_BACKEND, single.endpoint, name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "etcd3 loaded: False"


def test_the_backend_runs_beside_etcd3_s_own_stubs(single: EtcdServer, name: str) -> None:
    """A process that also uses another etcd client loads both sets of stubs.

    Both define etcdserverpb.RangeRequest and the rest; in one descriptor pool
    the second would fail to import ("duplicate symbol"), so ours have a pool
    of their own (etcdrpc/_pool.py).
    """
    pytest.importorskip("etcd3.etcdrpc", reason="etcd3-fc (the bench group) is not installed")
    code = "import etcd3.etcdrpc\n" + _USE_THE_BACKEND
    out = _python_with(code, single.endpoint, name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "etcd3 loaded: True"


def test_the_etcd_extra_s_floors_are_what_the_stubs_check() -> None:
    """pyproject's etcd extra against the versions written in the generated stubs.

    Stubs regenerated with another grpcio-tools (scripts/gen_etcd_stubs.py)
    check other versions as they import: the extra must follow.
    """
    stubs = ROOT / "django_dlock" / "backends" / "etcd" / "etcdrpc"
    extra = re.search(r"^etcd = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra is not None
    floors = dict(re.findall(r'"(grpcio|protobuf)>=([\d.]+)"', extra.group(1)))
    grpc_made = re.search(
        r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", (stubs / "rpc_pb2_grpc.py").read_text(), re.M
    )
    assert grpc_made is not None
    assert floors["grpcio"] == grpc_made.group(1)
    for module in ("auth_pb2.py", "kv_pb2.py", "rpc_pb2.py"):
        checked = re.search(
            r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
            r"\s*(\d+),\s*(\d+),\s*(\d+),",
            (stubs / module).read_text(),
        )
        assert checked is not None, module
        assert floors["protobuf"] == ".".join(checked.groups()), module


def test_keys_are_as_documented(single: EtcdServer, name: str) -> None:
    backend = locks["etcd"]
    with lock(f"{name}/sub", backend="etcd", metadata={"note": "n"}) as held:
        [kv] = keys(single.endpoint, "dlock/")[-1:]
        escaped = name.replace("%", "%25").replace("/", "%2F")
        lease_hex = kv["key"].rsplit("/", 1)[1]
        assert kv["key"] == f"dlock/{escaped}%2Fsub/{lease_hex}"
        assert int(lease_hex, 16) == kv["lease"]
        [epoch] = [e for e in keys(single.endpoint, "dlock-epochs/") if e["key"][-1].isdigit()][
            -1:
        ]
        assert kv["create_revision"] + json.loads(epoch["value"])["epoch"] == held.token
        assert json.loads(kv["value"])["note"] == "n"
        info = etcdctl(single.endpoint, "lease", "timetolive", lease_hex).stdout
        assert "remaining" in info, info
        [listed] = backend.list(f"{name}/")
        assert listed.name == f"{name}/sub"
    assert keys(single.endpoint, f"dlock/{escaped}") == []


def test_names_with_slashes_are_separate_locks(name: str) -> None:
    with lock(f"{name}/a", backend="etcd"), lock(f"{name}/a/b", backend="etcd", timeout=0):
        with lock(name, backend="etcd", timeout=0):
            names = [i.name for i in locks["etcd"].list(name)]
            assert names == [name, f"{name}/a", f"{name}/a/b"]


@pytest.mark.parametrize(
    "key", [b"dlock/x/1f", b"k" * 200, "dlock/\u00e9/".encode() + b"\xff" * 130]
)
@pytest.mark.parametrize("lease_id", [1, 127, 128, 2**62 + 5])
def test_hand_encoded_transactions_are_the_messages_they_stand_for(
    key: bytes, lease_id: int
) -> None:
    read = get(b"dlock/", b"dlock0", limit=2, keys_only=True, **CREATE_DESC)
    for value in (b"{}", b"x" * 300):
        expected = txn([created_at(key, 0)], [put(key, lease_id, value), read], [get(key)])
        assert queue_txn(key, lease_id, value, encode_op(read)) == expected.SerializeToString()
    for revision in (0, 1, 300, 2**40, 2**63 - 1):
        expected = txn([created_at(key, revision)], [delete(key)])
        assert delete_txn(key, revision) == expected.SerializeToString()


@pytest.mark.parametrize("alias", ["etcd", "etcd-cluster"])
def test_do_get_reads_the_lease_on_exactly_one_name(
    etcd_servers: dict[str, Any], alias: str, name: str
) -> None:
    """``do_get(name)``: the holder of ``name`` as ``list`` shows it, or None when free."""
    backend = locks[alias]
    assert isinstance(backend, EtcdBackend)
    assert backend.do_get(name) is None
    # Names that share its prefix are other locks: a range over the name's own keys.
    with backend.acquire(f"{name}/sub"), backend.acquire(f"{name}x"):
        assert backend.do_get(name) is None
        with backend.acquire(name, ttl=30, metadata={"note": "got"}) as held:
            info = backend.do_get(name)
            assert info is not None
            [listed] = [i for i in backend.list(name) if i.name == name]
            assert (info.backend, info.name, info.token) == (alias, name, held.token)
            assert info.token == listed.token
            assert info.holder == listed.holder
            assert info.holder["note"] == "got"
            assert info.acquired_at == listed.acquired_at
            assert 0 < info.expires_in <= 30
        assert backend.do_get(name) is None


@pytest.mark.parametrize("alias", ["etcd", "etcd-cluster"])
def test_do_get_is_none_once_the_lease_ran_out(
    etcd_servers: dict[str, Any], alias: str, name: str
) -> None:
    backend = locks[alias]
    assert isinstance(backend, EtcdBackend)
    held = backend.acquire(name, ttl=1, renew=False)  # a lease of its own, not renewed
    info = backend.do_get(name)
    assert info is not None
    assert info.token == held.token
    # etcd ends the lease after 1 s, and its leader looks for expired ones every 0.5 s.
    wait_for(lambda: backend.do_get(name) is None, 10, "the 1 s lease to run out")
    with pytest.raises(LockNotOwned):
        held.release()


def test_etcdctl_lock_waits_while_we_hold(single: EtcdServer, name: str) -> None:
    held = lock(name, backend="etcd").acquire()
    proc = etcdctl_popen(single.endpoint, "lock", f"dlock/{name}", "echo", "got-it")
    try:
        wait_for(lambda: len(keys(single.endpoint, f"dlock/{name}/")) == 2, 10, "etcdctl queued")
        time.sleep(0.5)
        assert proc.poll() is None, "etcdctl got the lock while we held it"
        held.release()
        out, _ = proc.communicate(timeout=20)
        assert "got-it" in out
    finally:
        proc.kill()
        proc.wait()


def test_we_wait_while_etcdctl_holds(single: EtcdServer, name: str) -> None:
    proc = etcdctl_popen(single.endpoint, "lock", f"dlock/{name}")
    try:
        assert proc.stdout is not None
        key = proc.stdout.readline().strip()  # printed once etcdctl holds the lock
        assert key.startswith(f"dlock/{name}/")
        with pytest.raises(LockTimeout):
            lock(name, backend="etcd", timeout=0).acquire()
        [info] = locks["etcd"].list(name)
        assert info.holder == {}  # etcdctl stores no metadata
        got: list[HeldLock] = []
        waiter = threading.Thread(
            target=lambda: got.append(lock(name, backend="etcd", timeout=30).acquire())
        )
        waiter.start()
        time.sleep(0.5)
        assert got == []
        proc.send_signal(signal.SIGINT)  # etcdctl revokes its session and exits
        waiter.join(30)
        assert got, "we did not get the lock after etcdctl let go"
        assert got[0].token > info.token
        got[0].release()
    finally:
        proc.kill()
        proc.wait()


# --- the queue --------------------------------------------------------------------------


def _queue_length(endpoint: str, name: str) -> int:
    return len(keys(endpoint, f"dlock/{name}/"))


def test_waiter_that_gives_up_leaves_the_queue(single: EtcdServer, name: str) -> None:
    with lock(name, backend="etcd"):
        with pytest.raises(LockTimeout):
            lock(name, backend="etcd", timeout=0.3).acquire()
        with pytest.raises(LockTimeout):
            lock(name, backend="etcd", timeout=0).acquire()
        assert _queue_length(single.endpoint, name) == 1


def test_waiter_that_dies_leaves_the_queue_with_its_lease(single: EtcdServer, name: str) -> None:
    holder = lock(name, backend="etcd").acquire()
    proc = python(
        f"b = EtcdBackend('x', {{'LOCATION': {single.endpoint!r}}})\n"
        f"b.acquire({name!r}, ttl=1, timeout=60)\n"
    )
    try:
        wait_for(lambda: _queue_length(single.endpoint, name) == 2, 20, "the process queued")
        got: list[HeldLock] = []
        waiter = threading.Thread(
            target=lambda: got.append(lock(name, backend="etcd", timeout=30).acquire())
        )
        waiter.start()
        wait_for(lambda: _queue_length(single.endpoint, name) == 3, 10, "the thread queued")
        proc.kill()  # the waiter ahead of our thread dies without a word
        proc.wait()
        holder.release()
        waiter.join(30)
        assert got, "the waiter behind a dead one was stranded"
        got[0].release()
    finally:
        proc.kill()
        proc.wait()


def test_holder_killed_frees_the_lock_when_its_lease_runs_out(
    single: EtcdServer, name: str
) -> None:
    proc = python(
        f"b = EtcdBackend('x', {{'LOCATION': {single.endpoint!r}}})\n"
        f"h = b.acquire({name!r}, ttl=1)\nprint(h.token, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    try:
        assert proc.stdout is not None
        token = int(proc.stdout.readline())
        proc.kill()
        proc.wait()
        # The watchdog renewed the 1 s lease while the process lived; once it
        # was killed the lease ran out by etcd's clock.
        with lock(name, backend="etcd", timeout=15) as held:
            assert held.token > token
    finally:
        proc.kill()
        proc.wait()


# --- leases -----------------------------------------------------------------------------


def test_one_session_lease_per_process_and_ttl(
    single: EtcdServer, name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    backend = make_backend(single.endpoint)
    a = backend.acquire(f"{name}:a")
    b = backend.acquire(f"{name}:b")
    c = backend.acquire(f"{name}:c", ttl=10)
    d = backend.acquire(f"{name}:d", renew=False)
    ours = [kv for kv in keys(single.endpoint, "dlock/") if kv["key"].startswith(f"dlock/{name}:")]
    lease = {kv["key"].split("/")[-2][-1]: kv["lease"] for kv in ours}
    assert lease["a"] == lease["b"], "two locks of one process and TTL share a session"
    assert lease["c"] != lease["a"], "another TTL is another session"
    assert lease["d"] not in (lease["a"], lease["c"]), "renew=False has a lease of its own"
    d.release()
    out = etcdctl(single.endpoint, "lease", "timetolive", f"{lease['d']:x}").stdout
    assert "already expired" in out or "not found" in out, out
    for held in (a, b, c):
        held.release()


def test_a_stale_renewal_does_not_move_the_key_back_onto_a_shorter_lease(
    single: EtcdServer, name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    """Issue 28 item 1 on etcd: a renewal built with ttl 3 arrives after ``extend(30)``."""
    backend = make_backend(single.endpoint)
    held = backend.acquire(name, ttl=3, renew=False)
    stale = [(name, held.owner, 3.0)]  # what the renewal thread had queued
    held.extend(30)
    assert backend.do_extend_many(stale) == [True]
    lease_hex = lease_of_key(single.endpoint, name)
    out = etcdctl(single.endpoint, "lease", "timetolive", lease_hex, "-w", "json").stdout
    assert json.loads(out)["granted-ttl"] == 30, out
    held.release()


def lease_of_key(endpoint: str, name: str) -> str:
    """The lease (hex) the key of ``name``'s holder is attached to now."""
    return f"{keys(endpoint, f'dlock/{name}/')[0]['lease']:x}"


def test_close_revokes_the_session(
    single: EtcdServer, name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    backend = make_backend(single.endpoint)
    held = backend.acquire(name, ttl=60)
    lease_hex = lease_of(single.endpoint, name)
    backend.close()
    # Released at once, not 60 s later.
    assert keys(single.endpoint, f"dlock/{name}/") == []
    out = etcdctl(single.endpoint, "lease", "timetolive", lease_hex).stdout
    assert "already expired" in out or "not found" in out, out
    assert held.lost or not backend.do_check(name, held.owner)


def test_exit_revokes_the_session(single: EtcdServer, name: str) -> None:
    proc = python(
        f"b = EtcdBackend('x', {{'LOCATION': {single.endpoint!r}}})\n"
        f"h = b.acquire({name!r}, ttl=60)\nprint(h.token, flush=True)\n"
        "import sys; sys.exit(0)  # without releasing\n"
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    assert proc.wait(timeout=30) == 0
    # Released by the exit, not 60 s later.
    assert keys(single.endpoint, f"dlock/{name}/") == []


def test_forked_child_has_its_own_session(
    single: EtcdServer, name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    from django_dlock.backends.etcd import backend as module

    backend = make_backend(single.endpoint)
    held = backend.acquire(name)
    parents = backend._state
    pid = os.fork()
    if pid == 0:  # the child: the parent's lock is not the child's
        code = 1
        try:
            # The parent's sessions and channels are kept, unused: freed, they
            # would run gRPC code in the child (docs/backends/etcd.md, "Fork").
            if backend._state is not None or not any(s is parents for s in module._inherited):
                os._exit(3)
            try:
                backend.acquire(name, timeout=0)
            except LockTimeout:
                with backend.acquire(f"{name}:child", timeout=0):
                    code = 0 if not backend.do_check(name, held.owner) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    held.ensure()  # the child's exit did not revoke the parent's session
    held.release()


def test_a_release_that_cannot_reach_etcd_is_finished_later(
    name: str, make_server: Callable[..., EtcdServer], make_backend: Callable[..., EtcdBackend]
) -> None:
    server = make_server("orphan")
    backend = make_backend(server.endpoint, timeout=1)
    keep = backend.acquire(f"{name}:keep", renew=False)
    gone = backend.acquire(name, renew=True)
    server.kill()
    with pytest.raises(BackendUnavailable):
        gone.release()
    server.start()  # same data dir: the session lease and both keys are back
    assert len(keys(server.endpoint, f"dlock/{name}/")) == 1
    backend.acquire(f"{name}:other").release()  # any later call finishes the release
    assert keys(server.endpoint, f"dlock/{name}/") == []
    with backend.acquire(name, timeout=0) as again:
        assert again.token > gone.token
    keep.release()


def test_a_revoked_session_is_replaced(
    single: EtcdServer, name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    backend = make_backend(single.endpoint)
    with backend.acquire(name):
        lease_hex = lease_of(single.endpoint, name)
    assert etcdctl(single.endpoint, "lease", "revoke", lease_hex).returncode == 0
    with backend.acquire(name, timeout=0):
        [kv] = keys(single.endpoint, f"dlock/{name}/")
        assert kv["key"].rsplit("/", 1)[1] != lease_hex


def test_ttl_is_rounded_up_to_whole_seconds(
    single: EtcdServer, name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    backend = make_backend(single.endpoint)
    with backend.acquire(name, ttl=2.5, renew=False) as held:
        lease_hex = lease_of(single.endpoint, name)
        out = etcdctl(single.endpoint, "lease", "timetolive", lease_hex).stdout
        assert "granted with TTL(3s)" in out, out
        # The handle counts on no more than it asked for.
        assert held.expires_in <= 2.5


# --- connections ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "mentions"),
    [
        ({"LOCATION": "redis://127.0.0.1:2379"}, "scheme"),
        ({"LOCATION": "127.0.0.1"}, "host:port"),
        ({"LOCATION": []}, "LOCATION"),
        ({"LOCATION": ["127.0.0.1:2379", 5]}, "endpoint"),
        ({"OPTIONS": {"cert": "/c.pem"}}, "go together"),
        ({"OPTIONS": {"user": "u"}}, "go together"),
        ({"OPTIONS": {"timeout": 0}}, "timeout"),
        ({"LOCATION": "http://127.0.0.1:2379", "OPTIONS": {"ca": "/ca.pem"}}, "https"),
    ],
)
def test_bad_settings_are_check_errors(params: dict[str, Any], mentions: str) -> None:
    with pytest.raises(LockConfigurationError, match=mentions):
        EtcdBackend("bad", params)
    setting = {"default": {"BACKEND": "django_dlock.backends.locmem.LocMemBackend"}}
    setting["e"] = {"BACKEND": ETCD, **params}
    with override_settings(DLOCK_BACKENDS=setting):
        errors = list(check_backends())
    assert [e.id for e in errors] == ["django_dlock.E006"], errors
    assert "'e'" in errors[0].msg


def test_missing_tls_file_is_a_check_error(tmp_path: Path) -> None:
    backend = EtcdBackend("tls", {"OPTIONS": {"ca": str(tmp_path / "nope.crt")}})
    [error] = backend.check()
    assert isinstance(error, checks.Error)
    assert "nope.crt" in error.msg


def test_unreachable_cluster_is_unavailable(
    name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    location = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    backend = make_backend(location, alias="down", timeout=0.5)
    with pytest.raises(BackendUnavailable, match="down"):
        backend.acquire(name, timeout=0)


def test_failover_to_the_next_endpoint(
    single: EtcdServer, name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    """A dead endpoint first in LOCATION costs a refused connection, not the lock."""
    backend = make_backend([f"127.0.0.1:{free_port()}", single.endpoint])
    backend.state.transport.current = 0
    with backend.acquire(name, timeout=0) as held:
        assert backend.list(name)[0].token == held.token


def test_tls_with_client_certificate(
    tls_files: dict[str, Path],
    name: str,
    make_server: Callable[..., EtcdServer],
    make_backend: Callable[..., EtcdBackend],
) -> None:
    server = make_server(
        "tls",
        "--cert-file", str(tls_files["cert"]),
        "--key-file", str(tls_files["key"]),
        "--trusted-ca-file", str(tls_files["ca"]),
        "--client-cert-auth",
        scheme="https",
    )  # fmt: skip
    url = f"https://{server.endpoint}"
    ca = str(tls_files["ca"])
    backend = make_backend(
        url, ca=ca, cert=str(tls_files["client_cert"]), key=str(tls_files["client_key"])
    )
    with backend.acquire(name, timeout=5) as held:
        assert backend.list(name)[0].token == held.token
    # Without the client certificate the server refuses us.
    with pytest.raises(BackendUnavailable):
        make_backend(url, ca=ca, timeout=1).acquire(name, timeout=0)


def test_user_and_password(
    name: str, make_server: Callable[..., EtcdServer], make_backend: Callable[..., EtcdBackend]
) -> None:
    server = make_server("auth")
    for args in (
        ["user", "add", "root:rootpw"],
        ["user", "add", "app:s3cret"],
        ["role", "add", "locks"],
        ["role", "grant-permission", "locks", "--prefix=true", "readwrite", "dlock/"],
        ["user", "grant-role", "app", "locks"],
        ["auth", "enable"],
    ):
        result = etcdctl(server.endpoint, *args)
        assert result.returncode == 0, result.stderr
    # Without the epochs' prefix (issue 28 item 6) the error says what to grant.
    with pytest.raises(BackendUnavailable, match="'dlock-epochs/' prefix too") as excinfo:
        make_backend(server.endpoint, user="app", password="s3cret").acquire(name, timeout=5)
    assert excinfo.value.transient is False
    granted = etcdctl(
        server.endpoint,
        "--user=root:rootpw",
        *["role", "grant-permission", "locks", "--prefix=true", "readwrite", "dlock-epochs/"],
    )
    assert granted.returncode == 0, granted.stderr
    backend = make_backend(server.endpoint, user="app", password="s3cret")
    with backend.acquire(name, timeout=5) as held:
        held.extend()
        assert [i.token for i in backend.list(name)] == [held.token]
    wrong = make_backend(server.endpoint, user="app", password="no")
    with pytest.raises(BackendUnavailable, match="auth"):
        wrong.acquire(name, timeout=0)
    # No retry fixes a wrong password: raised at once whatever the timeout (issue 16).
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="auth") as excinfo:
        wrong.acquire(name, timeout=15)
    assert time.monotonic() - started < 5, "a wrong password was retried"
    assert excinfo.value.transient is False


# --- a cluster losing members -------------------------------------------------------


def test_cluster_loses_a_follower_then_its_leader(name: str) -> None:
    """Four workers take turns on one lock while a 3-member cluster loses members.

    A follower is killed (and restarted), then the leader is killed. Every
    critical section is recorded with its start, end and token by one
    monotonic clock: no two may overlap, tokens must increase with start
    times, and workers must keep getting the lock after the new election.
    """
    ports = [(free_port(), free_port()) for _ in range(3)]
    members = start_etcd_cluster(ports, prefix="f")
    location = [m.endpoint for m in members]
    backends = [EtcdBackend(f"fo{i}", {"LOCATION": location}) for i in range(2)]
    records: list[tuple[float, float, int, int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    guard = threading.Lock()

    def worker(i: int) -> None:
        backend = backends[i % 2]
        while not stop.is_set():
            try:
                with backend.acquire(name, ttl=2, timeout=30) as held:
                    start = time.monotonic()
                    time.sleep(0.01)
                    end = time.monotonic()
                with guard:
                    records.append((start, end, held.token, i))
            except BaseException as e:
                errors.append(e)
                return

    def leader() -> EtcdServer:
        for _ in range(100):
            for m in members:
                if m.process is not None and m.is_leader():
                    return m
            time.sleep(0.1)
        raise RuntimeError("no leader")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)
        follower = next(m for m in members if m is not leader())
        follower.kill()
        phase_follower = time.monotonic()
        time.sleep(1.5)
        follower.start()
        time.sleep(1.0)
        old_leader = leader()
        old_leader.kill()
        phase_leader = time.monotonic()
        time.sleep(3.0)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        for b in backends:
            b.close()
        for m in members:
            m.cleanup()
    assert not errors, [str(e) for e in errors]
    records.sort()
    overlaps = [(a, b) for a, b in itertools.pairwise(records) if b[0] < a[1]]
    assert not overlaps, overlaps[:3]
    tokens = [r[2] for r in records]
    assert all(a < b for a, b in itertools.pairwise(tokens)), "tokens out of order"
    after_follower = [r for r in records if phase_follower < r[0] < phase_follower + 1.5]
    after_leader = [r for r in records if r[0] > phase_leader]
    assert after_follower, "no progress with a follower down"
    assert {r[3] for r in after_leader} == {0, 1, 2, 3}, (
        "a waiter did not proceed after the election"
    )
    print(
        f"\n[etcd failover] {len(records)} critical sections, {len(after_follower)} with a "
        f"follower down, {len(after_leader)} after the leader was killed; 0 overlaps"
    )


def test_settings_alias_uses_the_cluster(etcd_servers: dict[str, Any]) -> None:
    backend = locks["etcd-cluster"]
    assert isinstance(backend, EtcdBackend)
    assert backend.endpoints == [m.endpoint for m in etcd_servers["cluster"]]


def test_a_forgotten_handle_ends_while_other_locks_are_renewed(
    single: EtcdServer, name: str
) -> None:
    """Every renewed key shares the session lease: renewing one kept a dropped one alive.

    Issue 15: with TTL 2 s the dropped handle's key was still held after 8 s,
    while the process held another lock. The watchdog now releases it when
    its lease would have run out.
    """
    import gc

    backend = locks["etcd"]
    keeper = backend.acquire(f"{name}:kept", ttl=2)  # renewed all along
    backend.acquire(f"{name}:forgotten", ttl=2)  # the handle is dropped at once
    gc.collect()
    with pytest.raises(LockTimeout):
        backend.acquire(f"{name}:forgotten", timeout=0)  # not ended early
    with backend.acquire(f"{name}:forgotten", timeout=8) as again:
        again.ensure()
    keeper.ensure()
    keeper.release()


# --- riding out an outage (issue 16) ------------------------------------------------------


def test_acquire_rides_out_an_etcd_restart(
    name: str, make_server: Callable[..., EtcdServer], make_backend: Callable[..., EtcdBackend]
) -> None:
    """etcd killed and started again a second later: an acquire with a timeout waits it out."""
    server = make_server("outage")
    backend = make_backend(server.endpoint, timeout=1)
    backend.acquire(name, timeout=0).release()  # connected, with a session lease
    server.kill()
    restart = threading.Thread(target=lambda: (time.sleep(1.0), server.start()))
    restart.start()
    try:
        started = time.monotonic()
        held = backend.acquire(name, timeout=30)
        elapsed = time.monotonic() - started
    finally:
        restart.join(60)
    assert elapsed >= 0.8, "acquired while etcd was down?"
    held.ensure()
    assert [info.token for info in backend.list(name)] == [held.token]
    held.release()


def test_etcd_down_for_the_whole_timeout(
    name: str, make_server: Callable[..., EtcdServer], make_backend: Callable[..., EtcdBackend]
) -> None:
    server = make_server("outage")
    backend = make_backend(server.endpoint, timeout=0.5)
    backend.acquire(name, timeout=0).release()
    server.kill()
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match=r"retried for \d") as excinfo:
        backend.acquire(name, timeout=3)
    elapsed = time.monotonic() - started
    assert elapsed >= 0.8 * 3, f"gave up after {elapsed:.2f}s of a 3s timeout"
    assert excinfo.value.transient
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as excinfo:
        backend.acquire(name, timeout=0)  # fail fast: one try
    assert time.monotonic() - started < 2.5
    assert "retried" not in str(excinfo.value)


# --- semaphores and parked calls (issue 18) -------------------------------------------------


def _slot_keys(endpoint: str, name: str) -> list[dict[str, Any]]:
    return keys(endpoint, f"dlock-slots/{name}/")


def test_semaphore_waiters_are_granted_in_arrival_order(single: EtcdServer, name: str) -> None:
    """Three waiters queued one after another on a full semaphore enter in that order.

    A backend that lets whoever retries first after a release in would let
    them in in any order; the create-revision queue does not.
    """
    holder = semaphore(name, limit=1, backend="etcd", timeout=0).acquire()
    entered: list[tuple[int, int]] = []

    def wait(i: int) -> None:
        with semaphore(name, limit=1, backend="etcd", timeout=30) as held:
            entered.append((i, held.token))
            time.sleep(0.05)

    threads = []
    for i in range(3):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        wait_for(
            lambda n=i + 2: len(_slot_keys(single.endpoint, name)) == n, 10, f"waiter {i} queued"
        )
    holder.release()
    for t in threads:
        t.join(30)
    assert [i for i, _ in entered] == [0, 1, 2]
    tokens = [holder.token] + [token for _, token in entered]
    assert tokens == sorted(tokens) and len(set(tokens)) == 4
    assert _slot_keys(single.endpoint, name) == []


def test_a_slot_is_freed_when_its_session_lease_is_revoked(
    single: EtcdServer, name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    """A slot held with renew=True is on the process's session lease, as a mutex is.

    Revoking that lease (what etcd does when the process stops renewing it)
    frees the slot at once; the holder's ensure() says it is lost, and the
    process takes slots again on a new session lease.
    """
    backend = make_backend(single.endpoint)
    other = make_backend(single.endpoint, alias="other")
    held = backend.acquire(name, limit=1, timeout=0)
    mutex = backend.acquire(f"{name}:mutex")
    [slot] = _slot_keys(single.endpoint, name)
    assert slot["lease"] == keys(single.endpoint, f"dlock/{name}:mutex/")[0]["lease"]
    assert etcdctl(single.endpoint, "lease", "revoke", f"{slot['lease']:x}").returncode == 0
    with other.acquire(name, limit=1, timeout=10) as got:
        assert got.token > held.token
        with pytest.raises(LockLost):
            held.ensure()
        with pytest.raises(LockLost):
            mutex.ensure()
    with backend.acquire(name, limit=1, timeout=10) as again:
        [slot2] = _slot_keys(single.endpoint, name)
        assert slot2["lease"] != slot["lease"]
        again.ensure()


def test_a_slot_without_renewal_has_a_lease_of_its_own(
    single: EtcdServer, name: str, make_backend: Callable[..., EtcdBackend]
) -> None:
    backend = make_backend(single.endpoint)
    renewed = backend.acquire(name, limit=2, timeout=0)
    own = backend.acquire(name, limit=2, timeout=0, renew=False)
    a, b = _slot_keys(single.endpoint, name)
    assert a["lease"] != b["lease"]
    own.release()
    out = etcdctl(single.endpoint, "lease", "timetolive", f"{b['lease']:x}").stdout
    assert "already expired" in out or "not found" in out, out
    renewed.release()
    assert _slot_keys(single.endpoint, name) == []


def test_unpark_does_not_take_a_call_parked_again_meanwhile(
    single: EtcdServer, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """t0 unpark reads the queue, t1 the call is parked again with a new payload,
    t2 unpark deletes it: the new payload must not be lost with the old one."""
    backend = locks["etcd"]
    backend.do_park(name, "a", 10, "old")
    read = backend._parked
    raced: list[bool] = []

    def racing(*args: Any) -> Any:
        found = read(*args)
        if not raced:
            raced.append(True)
            backend.do_park(name, "a", 10, "new")
        return found

    monkeypatch.setattr(backend, "_parked", racing)
    taken = [p.payload for p in backend.do_unpark(name, 1)]
    monkeypatch.undo()
    left = [p.payload for p in backend.do_unpark(name, 5)]
    assert raced and taken + left == ["new"]


def _tokens(backend: EtcdBackend, name: str, count: int) -> list[int]:
    """``count`` tokens of ``name``, and one of a semaphore ``name``-s, from ``backend``."""
    tokens = []
    for _ in range(count):
        held = backend.acquire(name, timeout=0)
        tokens.append(held.token)
        held.release()
    held = backend.acquire(f"{name}-s", limit=2, timeout=0)
    tokens.append(held.token)
    held.release()
    return tokens


def _restart_on(server: EtcdServer, change: Callable[[], None]) -> None:
    server.kill()
    change()
    server.started_once = False  # a new member on a new data dir
    server.start()


def _restore(server: EtcdServer, snapshot: Path) -> None:
    """Replace the member's data dir with ``etcdctl snapshot restore`` of ``snapshot``."""
    shutil.rmtree(server.dir / "data")
    peer = f"http://127.0.0.1:{server.peer_port}"
    restored = etcdctl(
        "",
        "snapshot", "restore", str(snapshot),
        "--name", server.name,
        "--data-dir", str(server.dir / "data"),
        "--initial-cluster", f"{server.name}={peer}",
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster-token", f"dlock-{os.getpid()}-{server.peer_port}",
    )  # fmt: skip
    assert restored.returncode == 0, restored.stderr


@pytest.mark.parametrize("first", ["live", "fresh"])
@pytest.mark.parametrize("loss", ["wiped data dir", "older snapshot"])
def test_tokens_never_repeat_after_etcd_loses_its_data(
    name: str,
    loss: str,
    first: str,
    make_server: Callable[..., EtcdServer],
    make_backend: Callable[..., EtcdBackend],
) -> None:
    """Issue 28 item 6: etcd's revisions start again after a wiped data dir or a restore.

    Tokens were the create revisions, so a member started on a wiped data dir
    issued tokens 2, 3, ... again, and a restore from an older snapshot issued
    again those after the snapshot. They are now epoch + revision
    (``epochs.py``): a process running across the loss and one started after
    it both get tokens above every token issued before.
    """
    server = make_server("lost")
    live = make_backend(server.endpoint, timeout=2)
    before = _tokens(live, name, 3)
    snapshot = server.dir / "snapshot.db"
    if loss == "older snapshot":
        saved = etcdctl(server.endpoint, "snapshot", "save", str(snapshot))
        assert saved.returncode == 0, saved.stderr
    before += _tokens(live, name, 3)
    assert before[:3] == sorted(before[:3]) and before[4:7] == sorted(before[4:7])
    if loss == "older snapshot":
        _restart_on(server, lambda: _restore(server, snapshot))
    else:
        _restart_on(server, lambda: shutil.rmtree(server.dir / "data"))
    fresh = make_backend(server.endpoint, timeout=2)
    # The process that ran across the loss (it sees the revision go back), and
    # one started after it (it finds no epoch, or a revision above the raft
    # index), in either order.
    order = [live, fresh] if first == "live" else [fresh, live]
    after = _tokens(order[0], name, 2) + _tokens(order[1], name, 2)
    assert min(after) > max(before), (before, after)
    assert len(set(after)) == len(after)


def test_extend_with_a_ttl_below_etcds_minimum_keeps_the_shared_lease(
    name: str, make_server: Callable[..., EtcdServer], make_backend: Callable[..., EtcdBackend]
) -> None:
    """Issue 28 item 11: with ``ttl=1``, every extend moved each key onto a lease of its own.

    etcd grants no lease shorter than 1.5 election timeouts (2 s with its
    default timing): the session lease asked for 1 s was granted 2 s, and
    each ``extend()`` of 1 s, finding a lease of another TTL, moved the key to
    a new one (161 leases for 20 keys in 4 s). A TTL is compared with what was
    asked, not with what etcd raised it to.
    """
    server = make_server("default-timing", "--heartbeat-interval", "100",
                         "--election-timeout", "1000")  # fmt: skip
    backend = make_backend(server.endpoint, timeout=2)
    held = [backend.acquire(f"{name}-{i}", ttl=1, timeout=5) for i in range(5)]
    try:
        for _ in range(4):
            for one in held:
                one.extend()
        listed = etcdctl(server.endpoint, "lease", "list").stdout.splitlines()[1:]
        assert len(listed) == 1, listed
        assert {kv["lease"] for kv in keys(server.endpoint, "dlock/")} == {int(listed[0], 16)}
        assert all(one.expires_in > 0.5 for one in held)
    finally:
        for one in held:
            one.release()


@pytest.mark.parametrize("unrelated_writes", [0, 30])
def test_tokens_never_repeat_after_a_restore_from_a_snapshot_taken_after_a_restore(
    name: str,
    unrelated_writes: int,
    make_server: Callable[..., EtcdServer],
    make_backend: Callable[..., EtcdBackend],
) -> None:
    """Review of issue 28: a second restore repeated every token issued after its snapshot.

    The epoch made after the first restore was written in a restored log (its
    revision above its raft index), at the raft index every restore starts
    from; the second restore looked the same, so no new epoch was made. A log
    replaced since shows a larger revision - raft index than the epoch's.
    """
    server = make_server("restored-twice")
    first, second = server.dir / "first.db", server.dir / "second.db"
    issued = _tokens(make_backend(server.endpoint, timeout=2), name, 1)
    assert etcdctl(server.endpoint, "snapshot", "save", str(first)).returncode == 0
    issued += _tokens(make_backend(server.endpoint, timeout=2), name, 1)
    _restart_on(server, lambda: _restore(server, first))
    issued += _tokens(make_backend(server.endpoint, timeout=2), name, 2)
    assert etcdctl(server.endpoint, "snapshot", "save", str(second)).returncode == 0
    issued += _tokens(make_backend(server.endpoint, timeout=2), name, 10)
    _restart_on(server, lambda: _restore(server, second))
    for i in range(unrelated_writes):  # another application's writes
        etcdctl(server.endpoint, "put", f"other-app/{i}", "v")
    after = _tokens(make_backend(server.endpoint, timeout=2), name, 5)
    assert min(after) > max(issued), (issued, after)


def test_a_list_after_a_restore_makes_the_new_epoch(
    name: str, make_server: Callable[..., EtcdServer], make_backend: Callable[..., EtcdBackend]
) -> None:
    """docs/backends/etcd.md: after a restore, run ``locks list`` once before the workers.

    A process's first use looks for a restore, a list included: it makes the
    new epoch that every later acquisition reads in its own transaction.
    """
    server = make_server("restored")
    _tokens(make_backend(server.endpoint, timeout=2), name, 1)
    snapshot = server.dir / "snapshot.db"
    assert etcdctl(server.endpoint, "snapshot", "save", str(snapshot)).returncode == 0
    issued = _tokens(make_backend(server.endpoint, timeout=2), name, 3)

    def epochs() -> list[str]:
        return [
            kv["key"] for kv in keys(server.endpoint, "dlock-epochs/") if kv["key"][-1].isdigit()
        ]

    _restart_on(server, lambda: _restore(server, snapshot))
    assert len(epochs()) == 1
    make_backend(server.endpoint, timeout=2).list("")
    assert len(epochs()) == 2
    assert min(_tokens(make_backend(server.endpoint, timeout=2), name, 2)) > max(issued)


@pytest.mark.usefixtures("etcd_servers")
@pytest.mark.parametrize("renew", [True, False])
def test_override_settings_keeps_the_leases_granted_before(name: str, renew: bool) -> None:
    """Issue 28 item 11: override_settings(DLOCK_BACKENDS=...) revoked every etcd lease.

    The handler closed the old backend, which revokes its leases: a second
    acquire() was granted at once while the first handle still held. A lease
    taken with renew=False is not the watchdog's, and was still revoked
    (review of issue 28).
    """
    held = lock(name, backend="etcd", ttl=5, renew=renew).acquire()
    try:
        with override_settings(DLOCK_BACKENDS={**settings.DLOCK_BACKENDS}):
            with pytest.raises(LockTimeout):
                lock(name, backend="etcd", timeout=0).acquire()
            held.ensure()
    finally:
        held.release()
    with lock(name, backend="etcd", timeout=0) as again:
        assert again.token > held.token


_EXIT_WHILE_HOLDING = """
import atexit, sys, time
atexit.register(time.sleep, 1.5)  # runs after the backend's own exit handler
import django
django.setup()
from django_dlock import lock
from django_dlock.signals import lock_lost
lock_lost.connect(lambda sender, **kw: print("LOST", kw.get("reason"), flush=True), weak=False)
held = [lock(f"{sys.argv[1]}-{i}", backend="etcd", ttl=1).acquire() for i in range(3)]
print("HELD", flush=True)
"""


@pytest.mark.usefixtures("etcd_servers")
def test_no_lock_lost_as_the_interpreter_exits_holding(name: str) -> None:
    """Issue 28 item 11: at exit, etcd locks still held sent lock_lost.

    The exit handler revokes the process's leases; renewals that came after
    found them gone and reported each lost.
    """
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "testproject")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_WHILE_HOLDING, name],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(root),
    )
    assert "HELD" in out.stdout, out.stderr
    assert "LOST" not in out.stdout, out.stdout
    assert locks["etcd"].list(name) == []  # revoked: released at once


@pytest.mark.parametrize("run", range(3))
def test_a_process_s_first_acquisitions_leave_no_key_of_theirs_behind(
    etcd_servers: dict[str, Any], name: str, run: int
) -> None:
    """A new backend (a new process's) acquires on several threads at once.

    Its first look at the epochs makes the puts made meanwhile suspect; each
    is deleted and put anew. The delete compared the key's create revision
    before it was set (0), so the key stayed, under the session lease, ahead
    of the one put anew: that acquisition waited for its own key.
    """
    fresh = f"etcd-fresh-{run}"
    backends = {**settings.DLOCK_BACKENDS, fresh: settings.DLOCK_BACKENDS["etcd"]}
    names = [f"{name}:{i}" for i in range(8)]
    with override_settings(DLOCK_BACKENDS=backends):
        got: list[str] = []
        errors: list[BaseException] = []

        def take(each: str) -> None:
            try:
                with lock(each, backend=fresh, ttl=30, timeout=5):
                    got.append(each)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=take, args=(each,)) for each in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors, errors
        assert sorted(got) == names
        assert locks[fresh].list(name) == []
        locks[fresh].close()


def test_replies_coming_back_out_of_order_are_not_taken_for_lost_data(
    single: EtcdServer, make_backend: Callable[..., EtcdBackend], name: str
) -> None:
    """Calls of several threads at once: their replies come back in any order.

    Before: a reply showing an older revision than one another thread's reply
    had just shown marked the epochs suspect, as if etcd had lost data, and
    the acquisition whose put came next deleted its key and put it anew, at
    the back of the queue: async waiters on etcd were served out of the order
    they had queued in (tests/test_async_starvation.py, 1 to 3 of 6 runs).
    """
    from django_dlock.backends.etcd import etcdrpc as rpc

    backend = make_backend(single.endpoint)
    state = backend.state
    state.epochs.look(name)
    prefix = f"noise/{name}/".encode()

    def puts(thread: int) -> None:
        for i in range(50):
            key = prefix + b"%d-%d" % (thread, i)
            state.call(name, "kv", "Put", rpc.PutRequest(key=key, value=b"x"))

    threads = [threading.Thread(target=puts, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    state.call(
        name, "kv", "DeleteRange", rpc.DeleteRangeRequest(key=prefix, range_end=prefix[:-1] + b"0")
    )
    assert not state.epochs.suspect
