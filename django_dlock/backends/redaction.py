"""What a setting may show of itself in a message: never a password.

Every message, log line, page and ``repr`` that echoes a ``LOCATION`` (or a
URL from ``OPTIONS``) goes through :func:`redacted`, whatever the backend and
however malformed the value: a mistyped scheme or an unescaped ``/`` in a
password is exactly the setting that ends up in an error message.
"""

from __future__ import annotations

import re
from typing import Any

#: Query parameters whose values are secrets (redis-py reads ``?password=``).
_SECRET_PARAMS = re.compile(r"(?i)([?&;](?:password|passwd|pass|pwd|secret|token)=)[^&;#]*")


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
    rest = _SECRET_PARAMS.sub(r"\1***", rest)
    return f"{scheme}{sep}{rest}"
