"""The ticket of a detached lease (:class:`Ticket`): what ``HeldLock.detach()`` returns.

Another process adopts it (``locks[alias].adopt(ticket)``); it is
JSON-serializable, so it can travel in a message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._validation import validate_name, validate_ttl

__all__ = ["Ticket"]

#: Version of the ticket that ``HeldLock.detach()`` returns and ``adopt()`` reads.
TICKET_VERSION = 1


@dataclass(frozen=True)
class Ticket:
    """A detached lease in transit: what ``HeldLock.detach()`` returns, as a dict.

    The one place the ticket format is written (:meth:`to_dict`) and read
    (:meth:`parse`). ``state`` is what the backend's ``do_detach`` returned
    (JSON-serializable; None for most backends).
    """

    backend: str
    name: str
    owner: str
    token: int
    ttl: float
    holder: dict[str, Any]
    state: Any = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-serializable ticket, versioned."""
        return {
            "v": TICKET_VERSION,
            "backend": self.backend,
            "name": self.name,
            "owner": self.owner,
            "token": self.token,
            "ttl": self.ttl,
            "holder": self.holder,
            "state": self.state,
        }

    @classmethod
    def parse(cls, ticket: Mapping[str, Any], alias: str) -> Ticket:
        """Read a ticket for backend ``alias``; ``ValueError`` if it is not one, or not for it."""
        if not isinstance(ticket, Mapping) or ticket.get("v") != TICKET_VERSION:
            raise ValueError(f"Not a django-dlock lease ticket: {ticket!r}.")
        if ticket.get("backend") != alias:
            raise ValueError(
                f"The ticket is for lock backend {ticket.get('backend')!r}, not {alias!r}."
            )
        try:
            name = validate_name(ticket["name"])
            owner, token = ticket["owner"], int(ticket["token"])
            ttl = validate_ttl(ticket["ttl"])
            holder = dict(ticket.get("holder") or {})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Malformed django-dlock lease ticket {ticket!r}: {e}") from e
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"Malformed django-dlock lease ticket {ticket!r}: no owner.")
        return cls(alias, name, owner, token, ttl, holder, ticket.get("state"))
