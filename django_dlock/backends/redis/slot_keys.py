"""The keys of a Redis semaphore and of its queue of parked tasks: :class:`RedisSlotKeys`.

Shared by the semaphore part (``semaphores.py``, and its native async side in
``semaphores_aio.py``) and the parking part of :class:`~.backend.RedisBackend`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..base import BaseLockBackend
from .connections import Node


@dataclass(frozen=True)
class SlotKeys:
    """A semaphore's keys, in the order of the scripts' KEYS[1..9], and its queue's."""

    slots: list[str]
    done_prefix: str
    park: list[str]


class RedisSlotKeys(BaseLockBackend):
    """The keys of a semaphore and of its queue of parked tasks, and the runner of their scripts.

    Shared by :class:`RedisSemaphores` and :class:`RedisParking`.
    """

    if TYPE_CHECKING:
        # What RedisBackend provides: its nodes, tags, blocking bound, the
        # lifetime of retry markers and its runner that maps RedisError.
        shards: int
        _tags: list[str]
        _blocking_cap: float
        _done_ms: int

        @property
        def nodes(self) -> list[Node]: ...

        def tag(self, name: str) -> str: ...

        def _single(self, name: str, call: Callable[[Node], Any]) -> Any: ...

    def slot_keys(self, name: str) -> SlotKeys:
        t = self.tag(name)
        per_name = [f"{t}:sem:{kind}:{name}" for kind in ("h", "i", "w", "wi", "ww", "m", "wake")]
        return SlotKeys(
            slots=[*per_name, f"{t}:sem:fence", f"{t}:sem:idx"],
            done_prefix=f"{t}:done:sem:",
            park=[f"{t}:park:q:{name}", f"{t}:park:p:{name}", f"{t}:park:idx"],
        )

    def _marker(self, keys: SlotKeys, what: str) -> str:
        """A retry marker's key: one per request, so that only a resend finds it."""
        return f"{keys.done_prefix}{what}:{secrets.token_hex(8)}"

    def _slot_script(self, name: str, script: Any, keys: list[str], args: list[Any]) -> Any:
        return self._single(name, lambda node: node.run(script, keys, args))
