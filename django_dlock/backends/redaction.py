"""What a setting may show of itself in a message: never a password.

Every message, log line, page and ``repr`` that echoes a ``LOCATION`` (or a
URL from ``OPTIONS``) goes through :func:`redacted`, whatever the backend and
however malformed the value: a mistyped scheme or an unescaped ``/`` in a
password is exactly the setting that ends up in an error message.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_plus

#: Query parameters whose values are secrets (redis-py reads ``?password=``),
#: matched on the decoded key: redis-py reads ``passw%6Frd=`` as ``password=``.
_SECRET_KEY = re.compile(r"(?i)pass|pwd|secret|token|auth|cred")


def redacted(location: Any) -> str:
    """``location`` (a URL, ``host:port``, or a list of them) for messages.

    The userinfo (everything before the last ``@``, up to the ``scheme://``)
    keeps only its user name: ``redis://user:***@host:6379/0``. Without a
    ``:`` there is no telling a user name from a password, so it is hidden
    whole (``***@host``). The last ``@`` rather than the one before the first
    ``/``: a password with an unescaped ``/``, ``?`` or ``#`` (the URL is
    then malformed, and is being reported for it) is still hidden whole.
    Values of ``password=`` and similar query parameters become ``***``.
    """
    if isinstance(location, (list, tuple)):
        return ", ".join(redacted(item) for item in location)
    if not isinstance(location, str):
        return repr(location)
    scheme, sep, rest = location.partition("://")
    if not sep:
        scheme, rest = "", location
    userinfo, at, host = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        # The query, when the last "@" is in it, is part of what is hidden.
        rest = f"{user}:***@{host}" if colon and "/" not in user else f"***@{host}"
    return f"{scheme}{sep}{_query_redacted(rest)}"


def _query_redacted(text: str) -> str:
    """``text`` with the value of each secret-looking query parameter as ``***``.

    Split as redis-py splits a query: on ``&`` only, so a ``;`` in a
    password stays in what is hidden. What follows a ``#`` (a fragment,
    or the rest of a password whose ``#`` was not escaped) and a piece with
    no ``=`` (the rest of one whose ``&`` was not escaped) are hidden too.
    """
    head, mark, query = text.partition("?")
    if not mark:
        return text
    query, fragment, _ = query.partition("#")
    pieces = query.split("&")
    for i, piece in enumerate(pieces):
        key, equals, _ = piece.partition("=")
        if not equals and piece:
            pieces[i] = "***"
        elif equals and _SECRET_KEY.search(unquote_plus(key)):
            pieces[i] = f"{key}=***"
    return f"{head}?{'&'.join(pieces)}{fragment and '#***'}"
