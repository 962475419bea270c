"""The kinds of lease: :class:`MutexOps` and :class:`SlotOps`, one interface (``LeaseOps``).

Every acquisition names its kind: ``BaseLockBackend.acquire(name)`` a mutex,
``acquire(name, limit=N, weight=W)`` a slot of weight W in the semaphore of
limit N (a read/write lock is the semaphore of ``limits.RW_LIMIT``). The
:class:`~.attempts.Attempt`, the :class:`~django_dlock.held.HeldLock` and
the watchdog keep the real backend (``held.backend``) and the kind (``held.ops``)
apart, and make every call to the lease through the kind: try, leave the
queue, release, extend, check, extend many, detach, and the awaitable release,
extend and check. Neither pretends to be a backend. A slot's acquisition is
a :class:`SlotAttempt` (or the backend's subclass of it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from .attempts import Attempt
from .types import Grant, LockInfo

__all__ = ["MutexOps", "SlotAttempt", "SlotOps"]

if TYPE_CHECKING:
    from .protocol import MutexBackend, SlotBackend


class MutexOps:
    """A mutex on ``backend``: its ``do_*`` primitives, its ``attempt_class``."""

    limit: None = None
    weight = 1

    def __init__(self, backend: MutexBackend) -> None:
        self.backend = backend
        self.attempt_class: type[Attempt] = backend.attempt_class

    def __repr__(self) -> str:
        return f"<MutexOps of {self.backend!r}>"

    @property
    def renewal_key(self) -> Hashable:
        return self.backend.renewal_key

    @property
    def native_async(self) -> bool:
        return self.backend.native_async

    def attempt(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: tuple[dict[str, Any], str],
        renew: bool,
        template: str | None,
    ) -> Attempt:
        return self.attempt_class(self, name, owner, ttl, holder, renew, template)

    def try_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool
    ) -> int | Grant | None:
        return self.backend.do_acquire(name, owner, ttl, holder, renew=renew)

    def leave(self, name: str, owner: str) -> None:
        """A mutex's attempt records nothing to leave unless its attempt class does."""

    def release(self, name: str, owner: str) -> bool:
        return self.backend.do_release(name, owner)

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        return self.backend.do_extend(name, owner, ttl)

    def check(self, name: str, owner: str) -> bool:
        return self.backend.do_check(name, owner)

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]:
        return self.backend.do_extend_many(leases)

    def detach(self, name: str, owner: str) -> Any:
        return self.backend.do_detach(name, owner)

    def get(self, name: str, token: int) -> LockInfo | None:
        info = self.backend.get(name)
        return info if info is not None and info.token == token else None

    def break_lease(self, name: str, token: int) -> bool:
        return self.backend.break_lock(name, token)

    async def arelease(self, name: str, owner: str) -> bool:
        return await self.backend.ado_release(name, owner)

    async def aextend(self, name: str, owner: str, ttl: float) -> bool:
        return await self.backend.ado_extend(name, owner, ttl)

    async def acheck(self, name: str, owner: str) -> bool:
        return await self.backend.ado_check(name, owner)


class SlotAttempt(Attempt):
    """One acquisition of a slot: giving up withdraws its waiter record.

    Its waits are at most a third of its TTL apart, so that the waiter record
    (which ends a TTL after the last try) is refreshed before it runs out.
    """

    @property
    def limit(self) -> int:
        limit = self.ops.limit
        if limit is None:  # a slot attempt is made by SlotOps, which has one
            raise TypeError(f"{self!r} is not an attempt at a semaphore's slot.")
        return limit

    @property
    def weight(self) -> int:
        return self.ops.weight

    def wait(self, remaining: float | None) -> None:
        bound = self.ttl / 3
        super().wait(bound if remaining is None else min(remaining, bound))

    async def await_free(self, remaining: float | None) -> None:
        bound = self.ttl / 3
        await super().await_free(bound if remaining is None else min(remaining, bound))

    def abandon(self) -> None:
        self.ops.leave(self.name, self.owner)


class SlotOps:
    """A slot of ``weight`` in the semaphore ``limit`` on ``backend``: its ``*_slot`` primitives.

    Every slot of a backend is renewed with the others (``do_extend_slots_many``).
    """

    def __init__(self, backend: SlotBackend, limit: int, weight: int) -> None:
        self.backend = backend
        self.limit = limit
        self.weight = weight
        self.attempt_class: type[Attempt] = backend.slot_attempt_class or SlotAttempt
        self.renewal_key: Hashable = (backend, "slots")

    def __repr__(self) -> str:
        return f"<SlotOps of {self.backend!r} limit={self.limit} weight={self.weight}>"

    @property
    def native_async(self) -> bool:
        return self.backend.native_async_slots

    def attempt(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: tuple[dict[str, Any], str],
        renew: bool,
        template: str | None,
    ) -> Attempt:
        return self.attempt_class(self, name, owner, ttl, holder, renew, template)

    def try_acquire(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool
    ) -> int | Grant | None:
        return self.backend.do_acquire_slot(
            name, owner, ttl, holder, renew, self.limit, self.weight
        )

    def leave(self, name: str, owner: str) -> None:
        self.backend.do_leave_slot(name, owner)

    def release(self, name: str, owner: str) -> bool:
        return self.backend.do_release_slot(name, owner)

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        return self.backend.do_extend_slot(name, owner, ttl)

    def check(self, name: str, owner: str) -> bool:
        return self.backend.do_check_slot(name, owner)

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]:
        return self.backend.do_extend_slots_many(leases)

    def detach(self, name: str, owner: str) -> Any:
        raise TypeError(
            "A semaphore's or read/write lock's slot cannot be handed to another process."
        )

    def get(self, name: str, token: int) -> LockInfo | None:
        semaphore = self.backend.semaphore(name)
        holders = () if semaphore is None else semaphore.holders
        return next((info for info in holders if info.token == token), None)

    def break_lease(self, name: str, token: int) -> bool:
        return self.backend.break_slot(name, token) > 0

    async def arelease(self, name: str, owner: str) -> bool:
        return await self.backend.ado_release_slot(name, owner)

    async def aextend(self, name: str, owner: str, ttl: float) -> bool:
        return await self.backend.ado_extend_slot(name, owner, ttl)

    async def acheck(self, name: str, owner: str) -> bool:
        return await self.backend.ado_check_slot(name, owner)
