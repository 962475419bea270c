"""Reading leases back: LIST page by page over the index, GET for one name."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from datetime import datetime, timezone
from operator import attrgetter
from typing import Any

from ..._validation import load_holders
from ..base import LockInfo
from .connections import Node

#: Index entries a LIST call reads: about 10 ms of the server's time.
LIST_PAGE = 5000


def lex_range(prefix: str) -> tuple[str, str]:
    if not prefix:
        return "-", "+"
    # Names are UTF-8, which never contains byte 0xFF: every name starting
    # with the prefix sorts below prefix + 0xFF.
    return "[" + prefix, "(" + prefix + "\udcff"


def iter_node(node: Node, tags: list[str], prefix: str, alias: str) -> Iterator[LockInfo]:
    """The live leases on ``node`` whose names start with ``prefix``, in name order.

    Read a page (``LIST_PAGE`` index entries) at a time, so that no more than
    about two pages are in memory whatever the count. Each shard's index is
    in name order (ZRANGEBYLEX compares UTF-8 bytes, which sorts as Python
    compares str); several shards are merged. Each shard is read on a
    connection of its own, made for the listing: the next page's call is out
    while the caller holds a page, and a release the caller makes meanwhile
    on the thread's connection must not read that page as its reply.
    """
    shards = [_iter_shard(node, tag, prefix, alias) for tag in tags]
    if len(shards) == 1:
        return shards[0]
    return heapq.merge(*shards, key=attrgetter("name"))


def _iter_shard(node: Node, tag: str, prefix: str, alias: str) -> Iterator[LockInfo]:
    low, high = lex_range(prefix)
    args = [
        low.encode("utf-8", "surrogateescape"),
        high.encode("utf-8", "surrogateescape"),
        f"{tag}:lock:",
        LIST_PAGE,
    ]
    for reply in node.pages(node.list, [f"{tag}:idx"], args, own_connection=True):
        yield from parse_page(alias, reply)


def list_node(node: Node, tags: list[str], prefix: str, alias: str) -> dict[str, LockInfo]:
    """The live leases on ``node`` whose names start with ``prefix``, by name."""
    return {info.name: info for info in iter_node(node, tags, prefix, alias)}


def get_lease(node: Node, lock_key: str, name: str, alias: str) -> dict[str, LockInfo]:
    """``{name: lease}`` if ``name`` has a live lease on ``node``, else ``{}``: one GET script."""
    now_us, *lease = node.run(node.get, [lock_key], [])  # {now_us} or {now_us, value, pttl}
    if not lease:
        return {}
    (info,) = parse_page(alias, [now_us, "", name, *lease])
    return {name: info}


def parse_page(alias: str, reply: list[Any]) -> list[LockInfo]:
    """A LIST reply ``{now_us, next, name1, value1, pttl1, ...}`` as leases, in its order."""
    # Runs for every lease listed (a million for manage.py locks --json):
    # whole columns decoded by C calls, positional arguments, and the
    # datetime constructor held in a local.
    now_us = int(reply[0])
    names, values = _decoded(reply[2::3]), _decoded(reply[3::3])
    fields = [value.split(":", 3) for value in values]
    holders, faithful = load_holders([field[3] for field in fields])
    stamp, utc = datetime.fromtimestamp, timezone.utc
    return [
        LockInfo(
            alias,
            name,
            int(field[1]),
            holder,
            stamp(int(field[2]) / 1_000_000, utc),  # micros_to_datetime()
            stamp((now_us + pttl * 1000) / 1_000_000, utc),
            pttl / 1000,
            field[3] if faithful else None,
        )
        for name, field, holder, pttl in zip(
            names, fields, holders, map(int, reply[4::3]), strict=True
        )
    ]


def _decoded(column: list[Any]) -> list[str]:
    """A column of a reply as str: our own connections give bytes, a client made
    with ``decode_responses=True`` (django-redis can be) gives str."""
    if column and isinstance(column[0], bytes):
        return list(map(bytes.decode, column))
    return column
