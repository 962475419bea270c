"""The watchdog's batched renewals on Redis: one EXTEND_MANY per shard and batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ...clocks import ms
from ...exceptions import BackendUnavailable
from .scripts import lock_key


class RedisRenewals:
    """``do_extend_many`` for :class:`~.backend.RedisBackend`: a mixin, as its semaphores are.

    A batch's leases are split by shard (one hash tag each, so one Cluster
    slot) and each shard's part is one script call: 1,000 renewals cost one
    round trip instead of 1,000. Redlock keeps one renewal a call, each on a
    majority of its masters.
    """

    #: Leases a call: the script runs about 1 µs per lease on the server.
    renew_batch: ClassVar[int] = 1000

    tag: Callable[[str], str]
    _single: Callable[[str, Callable[[Any], Any]], Any]

    def do_extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | Exception]:
        shards: dict[str, list[int]] = {}
        for i, (name, _owner, _ttl) in enumerate(leases):
            shards.setdefault(self.tag(name), []).append(i)
        results: list[bool | Exception] = [False] * len(leases)
        for tag, indexes in shards.items():
            keys = [lock_key(tag, leases[i][0]) for i in indexes]
            args: list[Any] = []
            for i in indexes:
                args += (leases[i][1], ms(leases[i][2]))
            try:
                reply = self._single(leases[indexes[0]][0], _extend_many(keys, args))
            except BackendUnavailable as e:
                for i in indexes:
                    results[i] = e
                continue
            for i, extended in zip(indexes, reply, strict=True):
                results[i] = extended == 1
        return results


def _extend_many(keys: list[str], args: list[Any]) -> Callable[[Any], Any]:
    return lambda node: node.run(node.extend_many, keys, args)
