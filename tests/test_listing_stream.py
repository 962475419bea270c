"""Streamed listings: ``iter_list()`` and ``manage.py locks --json`` read page by page.

Against the session's own redis-server, with pages and output batches made
small so that a few leases cross many page boundaries.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_dlock import LockLost, lock, locks
from django_dlock.backends.redis import listing
from django_dlock.held import HeldLock
from django_dlock.management import formatting


def run(*args: str) -> str:
    out = StringIO()
    call_command("locks", *args, stdout=out, stderr=StringIO(), no_color=True)
    return out.getvalue()


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listing, "LIST_PAGE", 3)
    monkeypatch.setattr(formatting, "JSON_BATCH", 2)


def take(names: list[str], alias: str = "redis", ttl: float = 30) -> list[HeldLock]:
    # Short leases are left to run out: no watchdog renews them.
    return [lock(n, backend=alias, ttl=ttl, renew=ttl >= 1).acquire() for n in names]


def release(held: list[HeldLock]) -> None:
    for h in held:
        if not h.released:
            with contextlib.suppress(LockLost):
                h.release()


@pytest.mark.usefixtures("redis_servers", "small_pages")
def test_json_across_page_and_batch_boundaries_is_one_valid_array(name: str) -> None:
    names = [f"{name}:{i:02d}" for i in range(23)]
    held = take(names)
    try:
        text = run("--backend", "redis", "--prefix", name, "--json")
        items = json.loads(text)
        assert [(i["name"], i["token"]) for i in items] == [(h.name, h.token) for h in held]
        assert {i["kind"] for i in items} == {"mutex"}
        assert text.endswith("]\n")
        listed = locks["redis"].list(name)
        assert [i["holder"] for i in items] == [info.holder for info in listed]
    finally:
        release(held)


@pytest.mark.usefixtures("redis_servers", "small_pages")
def test_json_of_nothing_is_an_empty_array(name: str) -> None:
    assert run("--backend", "redis", "--prefix", name, "--json") == "[]\n"


@pytest.mark.usefixtures("redis_servers", "small_pages")
def test_iter_list_gives_what_list_gives(name: str) -> None:
    held = take([f"{name}:{i:02d}" for i in range(10)])
    try:
        streamed = [
            (i.name, i.token, i.holder, i.acquired_at) for i in locks["redis"].iter_list(name)
        ]
        listed = [(i.name, i.token, i.holder, i.acquired_at) for i in locks["redis"].list(name)]
        assert streamed == listed
        assert [i[0] for i in listed] == [h.name for h in held]
    finally:
        release(held)


@pytest.mark.usefixtures("redis_servers", "small_pages")
def test_leases_that_end_or_start_midway_are_listed_once_at_most(name: str) -> None:
    names = [f"{name}:{i:02d}" for i in range(30)]
    held = take(names[:20])
    short = take(names[20:25], ttl=0.3)
    try:
        leases = locks["redis"].iter_list(name)
        first = next(leases)  # the second page's call is on its way
        assert first.name == names[0]
        released, broken = held[10:13], held[13:16]
        release(released)
        for h in broken:
            assert locks["redis"].break_lock(h.name, token=h.token)
        late = take(names[25:])  # after the pages read so far: listed
        time.sleep(0.6)  # the short leases have ended
        rest = [info.name for info in leases]
        gone = {h.name for h in released + broken + short}
        assert rest == sorted(set(names[1:]) - gone)
        release(late)
    finally:
        release(held)


@pytest.mark.usefixtures("redis_servers", "small_pages")
def test_a_stream_stopped_midway_leaves_the_backend_usable(name: str) -> None:
    held = take([f"{name}:{i:02d}" for i in range(10)])
    try:
        leases = locks["redis"].iter_list(name)
        assert next(leases).name == held[0].name
        leases.close()  # type: ignore[attr-defined]
        assert [i.name for i in locks["redis"].iter_list(name)] == [h.name for h in held]
        held[5].ensure()
    finally:
        release(held)


def test_shards_of_one_server_are_merged_in_name_order(
    redis_servers: dict[str, Any], small_pages: None, name: str
) -> None:
    sharded = {
        "BACKEND": "django_dlock.backends.redis.RedisBackend",
        "LOCATION": locks["redis"].location,
        "KEY_PREFIX": f"{uuid.uuid4().hex}:",
        "OPTIONS": {"shards": 3},
    }
    with override_settings(DLOCK_BACKENDS={"default": sharded}):
        backend = locks["default"]
        names = [f"{name}:{i:02d}" for i in range(17)]
        held = take(names, alias="default")
        try:
            assert len({backend.tag(n) for n in names}) == 3  # type: ignore[attr-defined]
            leases = backend.iter_list(name)
            # Each shard's pages are read on a connection of its own.
            assert [next(leases).name for _ in range(4)] == names[:4]
            assert [info.name for info in leases] == names[4:]
            items = json.loads(run("--prefix", name, "--json"))
            assert [(i["name"], i["token"]) for i in items] == [(h.name, h.token) for h in held]
            for h in held:
                h.ensure()
        finally:
            release(held)


def test_a_backend_that_stops_midway_leaves_one_valid_array(small_pages: None) -> None:
    from django_dlock._validation import new_owner
    from tests.servers import RedisServer, free_port

    server = RedisServer(free_port()).start()
    config = {"default": {"BACKEND": "django_dlock.backends.redis.RedisBackend"}}
    config["default"]["LOCATION"] = server.url
    names = [f"midway:{i:02d}" for i in range(12)]

    class KillsTheServer(StringIO):
        """An output that stops the server once the first leases are written."""

        def write(self, text: str) -> int:
            if text.startswith("{"):
                server.kill()
            return super().write(text)

    try:
        with override_settings(DLOCK_BACKENDS=config):
            for n in names:
                assert locks["default"].do_acquire(n, new_owner(), 60, "{}")
            out, err = KillsTheServer(), StringIO()
            with pytest.raises(CommandError) as excinfo:
                call_command("locks", "--json", stdout=out, stderr=err, no_color=True)
            locks["default"].close()
    finally:
        server.cleanup()
    assert excinfo.value.returncode == 3
    assert err.getvalue().startswith("default: ")
    listed = [item["name"] for item in json.loads(out.getvalue())]
    assert 2 <= len(listed) < len(names)
    assert listed == names[: len(listed)]


def test_a_value_not_written_by_us_is_listed_whole(
    redis_servers: dict[str, Any], small_pages: None, name: str
) -> None:
    import redis

    client = redis.Redis(port=redis_servers["single"].port)
    client.set(f"{{dlock:0}}:lock:{name}:odd", "written by hand", px=30_000)
    client.zadd("{dlock:0}:idx", {f"{name}:odd": 0})
    try:
        (info,) = locks["redis"].list(name)
        assert (info.name, info.token, info.holder) == (
            f"{name}:odd",
            0,
            {"unparsed": "written by hand"},
        )
        assert json.loads(run("--backend", "redis", "--prefix", name, "--json"))[0]["token"] == 0
    finally:
        assert locks["redis"].break_lock(f"{name}:odd")


@pytest.mark.usefixtures("redis_servers", "small_pages")
def test_listings_give_their_connections_back(name: str) -> None:
    pool = locks["redis"].nodes[0].client.connection_pool  # type: ignore[attr-defined]
    held = take([f"{name}:{i:02d}" for i in range(5)])
    try:
        # More listings, whole or stopped early, than the pool has connections.
        for _ in range(pool.max_connections + 20):
            assert len(locks["redis"].list(name)) == 5
            leases = locks["redis"].iter_list(name)
            next(leases)
            leases.close()  # type: ignore[attr-defined]
    finally:
        release(held)
