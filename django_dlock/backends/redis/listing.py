"""Reading leases back: LIST page by page over the index, GET for one name."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from ..._validation import load_holders
from ..base import LockInfo
from .connections import Node, text

#: Index entries a LIST call reads: about 10 ms of the server's time.
LIST_PAGE = 5000


def lex_range(prefix: str) -> tuple[str, str]:
    if not prefix:
        return "-", "+"
    # Names are UTF-8, which never contains byte 0xFF: every name starting
    # with the prefix sorts below prefix + 0xFF.
    return "[" + prefix, "(" + prefix + "\udcff"


def list_node(node: Node, tags: list[str], prefix: str, alias: str) -> dict[str, LockInfo]:
    """The live leases on ``node`` whose names start with ``prefix``, by name."""
    low, high = lex_range(prefix)
    found: dict[str, LockInfo] = {}
    for tag in tags:
        args = [
            low.encode("utf-8", "surrogateescape"),
            high.encode("utf-8", "surrogateescape"),
            f"{tag}:lock:",
            LIST_PAGE,
        ]
        for reply in node.pages(node.list, [f"{tag}:idx"], args):
            found.update(parse_list(alias, reply))
    return found


def get_lease(node: Node, lock_key: str, name: str, alias: str) -> dict[str, LockInfo]:
    """``{name: lease}`` if ``name`` has a live lease on ``node``, else ``{}``: one GET script."""
    now_us, *lease = node.run(node.get, [lock_key], [])  # {now_us} or {now_us, value, pttl}
    return parse_list(alias, [now_us, "", name, *lease]) if lease else {}


def parse_list(alias: str, reply: list[Any]) -> dict[str, LockInfo]:
    """A LIST reply ``{now_us, next, name1, value1, pttl1, ...}`` as leases by name."""
    # Runs for every lease listed (100,000 for manage.py locks --json):
    # positional arguments and the datetime constructor held in locals.
    now_us = int(reply[0])
    values = [text(value).split(":", 3) for value in reply[3::3]]
    holders, faithful = load_holders([value[3] for value in values])
    stamp, utc = datetime.fromtimestamp, timezone.utc
    found = {}
    for name, (_owner, token_s, acquired_s, holder_text), holder, pttl in zip(
        map(text, reply[2::3]), values, holders, reply[4::3], strict=True
    ):
        pttl_ms = int(pttl)
        found[name] = LockInfo(
            alias,
            name,
            int(token_s),
            holder,
            stamp(int(acquired_s) / 1_000_000, utc),  # micros_to_datetime()
            stamp((now_us + pttl_ms * 1000) / 1_000_000, utc),
            pttl_ms / 1000,
            holder_text if faithful else None,
        )
    return found
