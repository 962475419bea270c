"""Redis semaphores from the event loop: :class:`RedisSemaphoresAsync`.

On one server (``native_async``) a semaphore's slot is tried, given up,
released, extended and checked from the event loop, with the same scripts
as the sync primitives (``slot_scripts.py``) on the loop's client
(``aio.py``), as the mutex's are (``native_async.py``): ``await
semaphore(...).aacquire()`` holds no thread. Its waits hold no connection
either (``RedisSlotAttempt.await_free``). A Cluster and a django-redis pool
keep the backend's threads (``native_async_slots`` is False).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...clocks import ms
from ..semaphore_backend import SemaphoreBackend
from ..types import Grant
from .slot_keys import RedisSlotKeys
from .slot_scripts import SLOT_ACQUIRE, SLOT_CHECK, SLOT_EXTEND, SLOT_LEAVE, SLOT_RELEASE

if TYPE_CHECKING:
    from .aio import AsyncNode


class RedisSemaphoresAsync(RedisSlotKeys, SemaphoreBackend):
    """The awaitable ``*_slot`` primitives of ``RedisBackend``, native on one server."""

    if TYPE_CHECKING:
        # What RedisBackend provides: whether it talks from the event loop,
        # the loop's client, and its runner that maps RedisError.
        native_async: bool
        _anode: AsyncNode

        async def _arun(self, name: str, call: Any) -> Any: ...

    @property
    def native_async_slots(self) -> bool:
        """On one server: the slots talk from the event loop, as the mutexes do."""
        return self.native_async

    def slot_outcome(
        self, name: str, limit: int, reply: Any, sent: float
    ) -> tuple[int | Grant | None, int]:
        """A SLOT_ACQUIRE reply sent at ``sent``: its result, and ms until it may change."""
        if not isinstance(reply, list):
            return int(reply), 0
        first, second = int(reply[0]), int(reply[1])
        if first > 0:
            # Ours already (a resend): the server had `second` ms left when it
            # answered, which was no earlier than `sent`.
            return Grant(first, sent + second / 1000, second / 1000), 0
        if first < 0:
            raise self.limit_mismatch(name, limit, second)
        return None, second

    async def _aslot_script(self, name: str, script: Any, keys: list[str], args: list[Any]) -> Any:
        return await self._arun(name, lambda a: a.run(script, keys, args))

    async def aacquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, limit: int, weight: int
    ) -> tuple[int | Grant | None, int]:
        """``acquire_slot`` from the event loop: one SLOT_ACQUIRE."""
        keys = self.slot_keys(name).slots
        args = [owner, name, ms(ttl), holder, limit, weight]
        sent, reply = await self._arun(name, lambda a: a.run_timed(SLOT_ACQUIRE, keys, args))
        return self.slot_outcome(name, limit, reply, sent)

    async def ado_leave_slot(self, name: str, owner: str) -> None:
        if not self.native_async_slots:
            return await super().ado_leave_slot(name, owner)
        await self._aslot_script(name, SLOT_LEAVE, self.slot_keys(name).slots, [owner, name])

    async def ado_release_slot(self, name: str, owner: str) -> bool:
        if not self.native_async_slots:
            return await super().ado_release_slot(name, owner)
        keys = self.slot_keys(name)
        marker = self._marker(keys, owner)
        args = [owner, name, self._done_ms]
        return bool(await self._aslot_script(name, SLOT_RELEASE, [*keys.slots, marker], args))

    async def ado_extend_slot(self, name: str, owner: str, ttl: float) -> bool:
        if not self.native_async_slots:
            return await super().ado_extend_slot(name, owner, ttl)
        args = [owner, name, ms(ttl)]
        return bool(await self._aslot_script(name, SLOT_EXTEND, self.slot_keys(name).slots, args))

    async def ado_check_slot(self, name: str, owner: str) -> bool:
        if not self.native_async_slots:
            return await super().ado_check_slot(name, owner)
        holders = self.slot_keys(name).slots[0]
        return bool(await self._aslot_script(name, SLOT_CHECK, [holders], [owner]))


__all__ = ["RedisSemaphoresAsync"]
