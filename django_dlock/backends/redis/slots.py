"""The Redis backend's semaphores, read/write locks and parked Celery calls.

Keys of semaphore ``name`` (all under the name's hash tag, so that one script
touches one Cluster slot; ``T`` is the tag):

``T:s:name``   zset  holder owner -> lease end, ms by the server's clock
``T:sd:name``  hash  holder owner -> "token:weight:acquired_us:holder JSON"
``T:sw:name``  zset  waiter owner -> end of its waiter record, ms
``T:sx:name``  zset  the waiters that are writers (weight == limit), the same
``T:sm:name``  hash  ``limit``, and ``used``: the weights held
``T:sk:name``  list  wake-ups: a release pushes one per waiter (BLPOP)
``T:sfence``   hash  name -> last fencing token (seeded from the server clock)
``T:sidx``     zset  names with holders or waiters, for listing by prefix

Every script first drops the holders and waiters whose ends have passed by
the server's clock. The per-name keys expire a second after the last lease
or waiter record in them could end, so an abandoned semaphore leaves only
its counter behind. Parked calls: ``T:pk:name`` (zset call id -> place),
``T:pd:name`` (hash call id -> payload) and ``T:pidx`` (names with parked
calls); they never expire.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from ..._validation import load_holder
from ..base import BaseLockBackend, Grant, LockInfo, ParkedTask, SlotEntry
from ..slots import SlotAttempt
from .connections import Node, text
from .listing import lex_range
from .scripts import LuaScript

#: Longest single blocking wait of a semaphore's waiter, seconds.
SLOT_WAIT_CAP = 1.0

# The prologue every slot script starts with: the server's clock, and the
# holders and waiters whose ends have passed dropped (with their weights).
_PROLOGUE = """
local t = redis.call('time')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local ended = redis.call('zrangebyscore', KEYS[1], '-inf', now_ms)
if #ended > 0 then
    local used = tonumber(redis.call('hget', KEYS[5], 'used') or 0)
    for _, o in ipairs(ended) do
        local d = redis.call('hget', KEYS[2], o)
        if d then used = used - tonumber(string.match(d, '^%d+:(%d+):')) end
        redis.call('hdel', KEYS[2], o)
    end
    redis.call('zremrangebyscore', KEYS[1], '-inf', now_ms)
    redis.call('hset', KEYS[5], 'used', used)
end
redis.call('zremrangebyscore', KEYS[3], '-inf', now_ms)
redis.call('zremrangebyscore', KEYS[4], '-inf', now_ms)
local function wake()
    local n = redis.call('zcard', KEYS[3])
    if n > 0 then
        redis.call('del', KEYS[6])
        for _ = 1, math.min(n, 64) do redis.call('rpush', KEYS[6], 1) end
        redis.call('pexpire', KEYS[6], 2000)
    end
end
local function tidy(name, index)
    if redis.call('zcard', KEYS[1]) == 0 and redis.call('zcard', KEYS[3]) == 0 then
        redis.call('del', KEYS[5])
        redis.call('zrem', index, name)
    end
end
local function keep(ttl_ms)
    for i = 1, 5 do
        if redis.call('pttl', KEYS[i]) < ttl_ms + 1000 then
            redis.call('pexpire', KEYS[i], ttl_ms + 1000)
        end
    end
end
"""

# KEYS[1..6] the per-name keys (module docstring, in order s, sd, sw, sx, sm,
# sk), KEYS[7] fence hash, KEYS[8] index. ARGV[1] owner, ARGV[2] ttl ms,
# ARGV[3] name, ARGV[4] holder JSON, ARGV[5] limit, ARGV[6] weight.
# Returns the new token; {token, ms left} if ARGV[1] holds a slot already (a
# resent call); {-1, ms until the first holder's lease ends} if refused (the
# caller is now a waiter); {-2, the limit held} for another limit.
SACQUIRE = LuaScript(
    _PROLOGUE
    + """
local limit, weight = tonumber(ARGV[5]), tonumber(ARGV[6])
local held_limit = tonumber(redis.call('hget', KEYS[5], 'limit') or 0)
if held_limit > 0 and held_limit ~= limit and
        (redis.call('zcard', KEYS[1]) > 0 or redis.call('zcard', KEYS[3]) > 0) then
    return {-2, held_limit}
end
local mine = redis.call('zscore', KEYS[1], ARGV[1])
if mine then
    local d = redis.call('hget', KEYS[2], ARGV[1])
    return {tonumber(string.match(d, '^(%d+):')), tonumber(mine) - now_ms}
end
local used = tonumber(redis.call('hget', KEYS[5], 'used') or 0)
local writers = redis.call('zcard', KEYS[4])
if redis.call('zscore', KEYS[4], ARGV[1]) then writers = writers - 1 end
local ttl_ms = tonumber(ARGV[2])
redis.call('hset', KEYS[5], 'limit', limit)
redis.call('zadd', KEYS[8], 0, ARGV[3])
if used + weight <= limit and not (weight < limit and writers > 0) then
    local token = math.max(tonumber(redis.call('hget', KEYS[7], ARGV[3]) or 0) + 1, now_us)
    local token_s = string.format('%d', token)
    redis.call('hset', KEYS[7], ARGV[3], token_s)
    redis.call('zadd', KEYS[1], now_ms + ttl_ms, ARGV[1])
    redis.call('hset', KEYS[2], ARGV[1],
        token_s .. ':' .. weight .. ':' .. string.format('%d', now_us) .. ':' .. ARGV[4])
    redis.call('hset', KEYS[5], 'used', used + weight)
    redis.call('zrem', KEYS[3], ARGV[1])
    redis.call('zrem', KEYS[4], ARGV[1])
    keep(ttl_ms)
    return token
end
redis.call('zadd', KEYS[3], now_ms + ttl_ms, ARGV[1])
if weight == limit then redis.call('zadd', KEYS[4], now_ms + ttl_ms, ARGV[1]) end
keep(ttl_ms)
local first = redis.call('zrange', KEYS[1], 0, 0, 'WITHSCORES')
return {-1, first[2] and (tonumber(first[2]) - now_ms) or 0}
"""
)

# KEYS[1..6], KEYS[7] index; ARGV[1] owner, ARGV[2] name.
# Returns 1 if ARGV[1] held a live slot (now released), else 0.
SRELEASE = LuaScript(
    _PROLOGUE
    + """
local d = redis.call('hget', KEYS[2], ARGV[1])
if not d or not redis.call('zscore', KEYS[1], ARGV[1]) then return 0 end
redis.call('zrem', KEYS[1], ARGV[1])
redis.call('hdel', KEYS[2], ARGV[1])
local used = tonumber(redis.call('hget', KEYS[5], 'used') or 0)
redis.call('hset', KEYS[5], 'used', used - tonumber(string.match(d, '^%d+:(%d+):')))
wake()
tidy(ARGV[2], KEYS[7])
return 1
"""
)

# KEYS[1..6], KEYS[7] index; ARGV[1] owner, ARGV[2] name. Forgets a waiter.
SLEAVE = LuaScript(
    _PROLOGUE
    + """
local was = redis.call('zrem', KEYS[3], ARGV[1])
if redis.call('zrem', KEYS[4], ARGV[1]) == 1 then wake() end
tidy(ARGV[2], KEYS[7])
return was
"""
)

# KEYS[1..6]; ARGV[1] owner, ARGV[2] ttl ms ("" to check only).
# Returns 1 if ARGV[1] holds a live slot (its lease now ends ttl from now).
SEXTEND = LuaScript(
    _PROLOGUE
    + """
if not redis.call('zscore', KEYS[1], ARGV[1]) then return 0 end
if ARGV[2] ~= '' then
    redis.call('zadd', KEYS[1], 'XX', now_ms + tonumber(ARGV[2]), ARGV[1])
    keep(tonumber(ARGV[2]))
end
return 1
"""
)

# KEYS[1..6], KEYS[7] index; ARGV[1] name, ARGV[2] token ("" for every slot).
# Returns how many slots were freed.
SBREAK = LuaScript(
    _PROLOGUE
    + """
local freed, used = 0, tonumber(redis.call('hget', KEYS[5], 'used') or 0)
local all = redis.call('hgetall', KEYS[2])
for i = 1, #all, 2 do
    local token, weight = string.match(all[i + 1], '^(%d+):(%d+):')
    if ARGV[2] == '' or token == ARGV[2] then
        redis.call('zrem', KEYS[1], all[i])
        redis.call('hdel', KEYS[2], all[i])
        used = used - tonumber(weight)
        freed = freed + 1
    end
end
if freed > 0 then
    redis.call('hset', KEYS[5], 'used', used)
    wake()
    tidy(ARGV[1], KEYS[7])
end
return freed
"""
)

# KEYS[1..6], KEYS[7] index; ARGV[1] name. Drops the name from the index if
# it has nobody left. Returns, flattened: now_ms, limit, #holders,
# (lease end ms, data) per holder, #waiters, #writers among them.
SREAD = LuaScript(
    _PROLOGUE
    + """
local out = {now_ms, tonumber(redis.call('hget', KEYS[5], 'limit') or 0)}
local holders = redis.call('zrange', KEYS[1], 0, -1, 'WITHSCORES')
table.insert(out, #holders / 2)
for i = 1, #holders, 2 do
    table.insert(out, holders[i + 1])
    table.insert(out, redis.call('hget', KEYS[2], holders[i]) or '')
end
table.insert(out, redis.call('zcard', KEYS[3]))
table.insert(out, redis.call('zcard', KEYS[4]))
tidy(ARGV[1], KEYS[7])
return out
"""
)

# KEYS[1] parked zset, KEYS[2] payload hash, KEYS[3] parked index;
# ARGV[1] call id, ARGV[2] place, ARGV[3] payload, ARGV[4] name.
SPARK = LuaScript("""
redis.call('zadd', KEYS[1], ARGV[2], ARGV[1])
redis.call('hset', KEYS[2], ARGV[1], ARGV[3])
redis.call('zadd', KEYS[3], 0, ARGV[4])
return 1
""")

# KEYS as SPARK; ARGV[1] how many, ARGV[2] name, ARGV[3] one call id ("": the first).
# Returns {id, place, payload}... removed.
SUNPARK = LuaScript("""
local ids
if ARGV[3] ~= '' then
    local place = redis.call('zscore', KEYS[1], ARGV[3])
    ids = place and {ARGV[3], place} or {}
else
    ids = redis.call('zrange', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
end
local out = {}
for i = 1, #ids, 2 do
    table.insert(out, ids[i])
    table.insert(out, ids[i + 1])
    table.insert(out, redis.call('hget', KEYS[2], ids[i]) or '')
    redis.call('zrem', KEYS[1], ids[i])
    redis.call('hdel', KEYS[2], ids[i])
end
if redis.call('zcard', KEYS[1]) == 0 then redis.call('zrem', KEYS[3], ARGV[2]) end
return out
""")


class RedisSlotAttempt(SlotAttempt):
    """Blocks on the semaphore's wake-up list (BLPOP) between tries."""

    #: The first holder's lease left at the last refusal, ms (0: unknown).
    first_end_ms: int = 0

    def try_acquire(self) -> int | Grant | None:
        base: RedisSlots = self.backend.base  # type: ignore[assignment]
        result, self.first_end_ms = base.try_slot(
            self.name, self.owner, self.ttl, self.holder[1], self.backend.limit,
            self.backend.weight,
        )  # fmt: skip
        return result

    def wait(self, remaining: float | None) -> None:
        base: RedisSlots = self.backend.base  # type: ignore[assignment]
        timeout = min(SLOT_WAIT_CAP, self.ttl / 3)
        if self.first_end_ms > 0:
            timeout = min(timeout, self.first_end_ms / 1000 + 0.001)
        if remaining is not None:
            timeout = min(timeout, remaining)
        if timeout >= 0.001:
            base.block_on_slot(self.name, timeout)


class RedisSlots(BaseLockBackend):
    """The ``*_slot`` and parking primitives of :class:`~.backend.RedisBackend`."""

    supports_semaphores = True
    supports_fair_semaphores = False
    slot_attempt_class = RedisSlotAttempt

    if TYPE_CHECKING:
        _tags: list[str]

        @property
        def nodes(self) -> list[Node]: ...
        def _tag(self, name: str) -> str: ...
        def _single(self, name: str, call: Any) -> Any: ...

    def _slot_keys(self, name: str) -> list[str]:
        tag = self._tag(name)
        return [f"{tag}:{kind}:{name}" for kind in ("s", "sd", "sw", "sx", "sm", "sk")]

    def try_slot(
        self, name: str, owner: str, ttl: float, holder: str, limit: int, weight: int
    ) -> tuple[int | Grant | None, int]:
        """One try: (token, a Grant or None; the first holder's lease left in ms)."""
        tag = self._tag(name)
        keys = [*self._slot_keys(name), f"{tag}:sfence", f"{tag}:sidx"]
        args = [owner, max(1, round(ttl * 1000)), name, holder, limit, weight]
        sent = time.monotonic()
        reply = self._single(name, lambda node: node.run(SACQUIRE, keys, args))
        if not isinstance(reply, list):
            return int(reply), 0
        code, value = int(reply[0]), int(reply[1])
        if code == -2:
            raise self.limit_mismatch(name, limit, value)
        if code == -1:
            return None, value
        return Grant(code, sent + value / 1000, value / 1000), 0  # held already

    def block_on_slot(self, name: str, timeout: float) -> None:
        """Wait for a release, break or leave of ``name`` to push a wake-up, or ``timeout``."""
        key = self._slot_keys(name)[5]
        timeout = min(timeout, getattr(self, "_blocking_cap", SLOT_WAIT_CAP))
        try:
            self.nodes[0].command("BLPOP", key, round(timeout, 3))
        except RedisError:
            time.sleep(min(timeout, 0.1))  # the next try reports the outage

    def do_acquire_slot(
        self, name: str, owner: str, ttl: float, holder: str, renew: bool, limit: int, weight: int
    ) -> int | Grant | None:
        return self.try_slot(name, owner, ttl, holder, limit, weight)[0]

    def _slot_script(self, name: str, script: LuaScript, args: list[Any], index: bool) -> Any:
        keys = self._slot_keys(name)
        if index:
            keys.append(f"{self._tag(name)}:sidx")
        return self._single(name, lambda node: node.run(script, keys, args))

    def do_leave_slot(self, name: str, owner: str) -> None:
        self._slot_script(name, SLEAVE, [owner, name], True)

    def do_release_slot(self, name: str, owner: str) -> bool:
        return bool(self._slot_script(name, SRELEASE, [owner, name], True))

    def do_extend_slot(self, name: str, owner: str, ttl: float) -> bool:
        return bool(self._slot_script(name, SEXTEND, [owner, max(1, round(ttl * 1000))], False))

    def do_check_slot(self, name: str, owner: str) -> bool:
        return bool(self._slot_script(name, SEXTEND, [owner, ""], False))

    def do_break_slot(self, name: str, token: int | None) -> int:
        arg = "" if token is None else str(token)
        return int(self._slot_script(name, SBREAK, [name, arg], True))

    def _names(self, index: str, prefix: str) -> list[tuple[str, str]]:
        """(tag, name) of every name in the ``index`` zsets whose name starts with ``prefix``."""
        low, high = lex_range(prefix)
        found: list[tuple[str, str]] = []
        for tag in self._tags:
            names = self._single(
                prefix,
                lambda node, tag=tag: node.command(
                    "ZRANGEBYLEX", f"{tag}:{index}",
                    low.encode("utf-8", "surrogateescape"),
                    high.encode("utf-8", "surrogateescape"),
                ),
            )  # fmt: skip
            found.extend((tag, text(n)) for n in names)
        return found

    def do_list_slots(self, prefix: str) -> list[SlotEntry]:
        entries: list[SlotEntry] = []
        wall_ms = time.time_ns() // 1_000_000
        for _tag, name in self._names("sidx", prefix):
            reply = self._slot_script(name, SREAD, [name], True)
            now_ms, limit, count = int(reply[0]), int(reply[1]), int(reply[2])
            for i in range(count):
                end_ms, data = int(float(reply[3 + 2 * i])), text(reply[4 + 2 * i])
                if not data:
                    continue
                token, weight, acquired, holder = data.split(":", 3)
                left = (end_ms - now_ms) / 1000
                info = LockInfo(
                    self.alias, name, int(token), load_holder(holder),
                    datetime.fromtimestamp(int(acquired) / 1e6, timezone.utc),
                    datetime.fromtimestamp((wall_ms + left * 1000) / 1000, timezone.utc),
                    left, holder,
                )  # fmt: skip
                entries.append(SlotEntry(name, limit, int(weight), info))
            waiters, writers = int(reply[3 + 2 * count]), int(reply[4 + 2 * count])
            entries.extend(SlotEntry(name, limit, limit, None) for _ in range(writers))
            entries.extend(SlotEntry(name, limit, 1, None) for _ in range(waiters - writers))
        return entries

    # --- parked Celery calls ----------------------------------------------------------

    def _park_keys(self, name: str) -> list[str]:
        tag = self._tag(name)
        return [f"{tag}:pk:{name}", f"{tag}:pd:{name}", f"{tag}:pidx"]

    def do_park(self, name: str, key: str, order: int, payload: str) -> None:
        keys = self._park_keys(name)
        self._single(name, lambda node: node.run(SPARK, keys, [key, order, payload, name]))

    def _unpark(self, name: str, count: int, key: str) -> list[ParkedTask]:
        keys = self._park_keys(name)
        reply = self._single(name, lambda node: node.run(SUNPARK, keys, [count, name, key]))
        return [
            ParkedTask(name, text(reply[i]), int(float(reply[i + 1])), text(reply[i + 2]))
            for i in range(0, len(reply), 3)
        ]

    def do_unpark(self, name: str, count: int) -> list[ParkedTask]:
        return self._unpark(name, count, "")

    def do_unpark_key(self, name: str, key: str) -> bool:
        return bool(self._unpark(name, 1, key))

    def do_list_parked(self, prefix: str) -> list[ParkedTask]:
        parked: list[ParkedTask] = []
        for _tag, name in self._names("pidx", prefix):
            zkey, hkey, _ = self._park_keys(name)
            places = self._single(
                name, lambda node, zkey=zkey: node.command("ZRANGE", zkey, 0, -1, "WITHSCORES")
            )
            payloads = self._single(name, lambda node, hkey=hkey: node.command("HGETALL", hkey))
            by_id = {text(k): text(v) for k, v in _pairs(payloads)}
            for call_id, place in _pairs(places):
                key = text(call_id)
                parked.append(ParkedTask(name, key, int(float(place)), by_id.get(key, "")))
        return parked


def _pairs(reply: Any) -> list[tuple[Any, Any]]:
    """A reply of pairs, whichever shape the client gave it: a dict, [[a, b]...] or [a, b...]."""
    if isinstance(reply, dict):
        return list(reply.items())
    if reply and isinstance(reply[0], (list, tuple)):
        return [(a, b) for a, b in reply]
    return [(reply[i], reply[i + 1]) for i in range(0, len(reply), 2)]
