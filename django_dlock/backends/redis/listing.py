"""Reading leases back: LIST page by page over the index, GET for one name."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from datetime import datetime, timezone
from operator import attrgetter
from typing import Any

from ..._validation import load_holders
from ..base import LockInfo
from .connections import Node, text
from .scripts import lock_key

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
        lock_key(tag, ""),
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
    value, pttl = lease
    _owner, token, acquired, holder = (text(value)).split(":", 3)
    (info,) = parse_page(alias, [now_us, "", name, token, acquired, holder, pttl])
    return {name: info}


def parse_page(alias: str, reply: list[Any]) -> list[LockInfo]:
    """A LIST reply ``{now_us, next, name1, token1, acquired_us1, holder1, pttl1, ...}``
    as leases, in its order."""
    # Runs for every lease listed (a million for manage.py locks --json): the
    # columns are read by C calls (int() takes bytes), and the loop passes
    # positional arguments and holds the datetime constructor in a local.
    now_us = int(reply[0])
    names, texts = _decoded(reply[2::5]), _decoded(reply[5::5])
    holders, faithful = load_holders(texts)
    stamp, utc = datetime.fromtimestamp, timezone.utc
    return [
        LockInfo(
            alias,
            name,
            token,
            holder,
            stamp(acquired_us / 1_000_000, utc),  # micros_to_datetime()
            stamp((now_us + pttl * 1000) / 1_000_000, utc),
            pttl / 1000,
            holder_text if faithful else None,
        )
        for name, token, acquired_us, holder, holder_text, pttl in zip(
            names,
            map(int, reply[3::5]),
            map(int, reply[4::5]),
            holders,
            texts,
            map(int, reply[6::5]),
            strict=True,
        )
    ]


def _decoded(column: list[Any]) -> list[str]:
    """A column of a reply as str: our own connections give bytes, a client made
    with ``decode_responses=True`` (django-redis can be) gives str."""
    if column and isinstance(column[0], bytes):
        return list(map(bytes.decode, column))
    return column
