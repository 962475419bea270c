"""The Lua scripts of semaphores, read/write locks and the parked-task queue.

Each runs atomically on the server, judges leases by the server's clock
(``TIME``; Redis 7 replicates a script by its effects, so a replica or the
AOF sees the writes, not a second reading of the clock), and touches only the
keys of one semaphore and its shard's fence, index and markers, which share
one hash tag: they run on a Redis Cluster as on one server. The helpers
(``prune``, ``touch``, ``wake``, ``settle``) are written out in each script
that needs one, so that each reads on its own; ``tests/test_redis.py`` checks
that the copies agree.

The semaphore scripts share one key layout, for shard tag T and name N:
KEYS[1] ``T:sem:h:N`` holders zset (owner -> lease end in ms by the server
clock), KEYS[2] ``T:sem:i:N`` holders hash (owner -> "token:weight:
acquired_us:holder JSON"), KEYS[3] ``T:sem:w:N`` waiters zset (owner -> end
of its waiter record in ms), KEYS[4] ``T:sem:wi:N`` waiters' weights hash,
KEYS[5] ``T:sem:ww:N`` waiting writers zset (the waiters whose weight is the
whole limit, with the same ends), KEYS[6] ``T:sem:m:N`` meta hash ("limit"),
KEYS[7] ``T:sem:wake:N`` wake list, KEYS[8] ``T:sem:fence`` hash (N -> last
token; never expires), KEYS[9] ``T:sem:idx`` index zset (N with score 0); and
the same first ARGVs: ARGV[1] owner token, ARGV[2] the name N.

KEYS[1..6] all get, at each grant or refresh, a PEXPIRE to the latest lease
or waiter record end: a semaphore nobody comes back to vanishes by itself.
The fence does not: a token is ``max(last + 1, server clock in us)``, as a
mutex's (``scripts.ACQUIRE``), so it never repeats or goes back, even when
the server restarts without its data.

A release, a break or a waiting writer leaving sets the wake list to one
element per waiter (up to WAKE_MAX), which lives SIGNAL_TTL_MS: each waiter
blocked on it (BLPOP) pops one and tries again. Retried commands (a reply
lost, the command resent) are made harmless as the mutex's are: RELEASE,
BREAK, UNPARK and UNPARK_KEY leave a short-lived marker per request that
makes a resend answer as the first run did.
"""

from __future__ import annotations

from .scripts import LuaScript

#: A release wakes at most this many waiters; the others re-check by their
#: wait's bound (WAIT_CAP at the latest).
WAKE_MAX = 1000

# --- SLOT_ACQUIRE: one attempt at a slot -----------------------------------------------
# KEYS[1..9], ARGV[1..2]: the layout above; ARGV[3] ttl ms, ARGV[4] holder
# JSON, ARGV[5] limit, ARGV[6] weight.
# Drops ended leases and waiter records; grants if the weights held plus
# ARGV[6] fit in the limit and, when ARGV[6] < limit, no other writer waits.
# Returns the new token (> 0); {token, ms left} if ARGV[1] holds a slot
# already (a resend after a lost reply); {-1, their limit} if live holders
# or waiters have another limit; when refused (ARGV[1] is then recorded as a
# waiter for ARGV[3] ms), {0, ms until the earliest lease or waiting writer
# that holds it back ends}.
SLOT_ACQUIRE = LuaScript("""
local now_t = redis.call('time')
local now_us = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])
local now_ms = math.floor(now_us / 1000)

local function prune()
    for _, owner in ipairs(redis.call('zrangebyscore', KEYS[1], '-inf', now_ms)) do
        redis.call('zrem', KEYS[1], owner)
        redis.call('hdel', KEYS[2], owner)
    end
    for _, owner in ipairs(redis.call('zrangebyscore', KEYS[3], '-inf', now_ms)) do
        redis.call('zrem', KEYS[3], owner)
        redis.call('zrem', KEYS[5], owner)
        redis.call('hdel', KEYS[4], owner)
    end
end

local function touch()
    local deadline = now_ms + 1
    for _, key in ipairs({KEYS[1], KEYS[3]}) do
        local last = redis.call('zrange', key, -1, -1, 'WITHSCORES')
        if last[2] then deadline = math.max(deadline, tonumber(last[2])) end
    end
    for i = 1, 6 do redis.call('pexpire', KEYS[i], deadline - now_ms) end
end

prune()
local mine = redis.call('zscore', KEYS[1], ARGV[1])
if mine then
    local info = redis.call('hget', KEYS[2], ARGV[1])
    return {tonumber(string.match(info, '^(%d+):')), tonumber(mine) - now_ms}
end

local limit, weight = tonumber(ARGV[5]), tonumber(ARGV[6])
if redis.call('zcard', KEYS[1]) + redis.call('zcard', KEYS[3]) > 0 then
    local theirs = tonumber(redis.call('hget', KEYS[6], 'limit') or limit)
    if theirs ~= limit then return {-1, theirs} end
end
redis.call('hset', KEYS[6], 'limit', ARGV[5])

local used = 0
for _, info in ipairs(redis.call('hvals', KEYS[2])) do
    used = used + tonumber(string.match(info, '^%d+:(%d+):'))
end
local writers = false
if used + weight <= limit and weight < limit then
    writers = redis.call('zcard', KEYS[5]) > 0
end

if used + weight <= limit and not writers then
    local token = math.max(tonumber(redis.call('hget', KEYS[8], ARGV[2]) or 0) + 1, now_us)
    local token_s = string.format('%d', token)
    redis.call('hset', KEYS[8], ARGV[2], token_s)
    redis.call('zadd', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[1])
    redis.call('hset', KEYS[2], ARGV[1],
        token_s .. ':' .. ARGV[6] .. ':' .. string.format('%d', now_us) .. ':' .. ARGV[4])
    redis.call('zrem', KEYS[3], ARGV[1])
    redis.call('zrem', KEYS[5], ARGV[1])
    redis.call('hdel', KEYS[4], ARGV[1])
    redis.call('zadd', KEYS[9], 0, ARGV[2])
    touch()
    return token
end

local ends = now_ms + tonumber(ARGV[3])
redis.call('zadd', KEYS[3], ends, ARGV[1])
redis.call('hset', KEYS[4], ARGV[1], ARGV[6])
if weight == limit then redis.call('zadd', KEYS[5], ends, ARGV[1]) end
redis.call('zadd', KEYS[9], 0, ARGV[2])
touch()
local first = redis.call('zrange', writers and KEYS[5] or KEYS[1], 0, 0, 'WITHSCORES')
local change = 0
if first[2] then change = tonumber(first[2]) - now_ms end
return {0, change}
""")

# --- SLOT_LEAVE: an attempt gives up ----------------------------------------------------
# KEYS[1..9], ARGV[1..2]: the layout above.
# Forgets ARGV[1]'s waiter record; a writer's leaving wakes the readers it held back.
# Returns 1 if ARGV[1] had a waiter record, else 0.
SLOT_LEAVE = LuaScript("""
local function wake()
    local n = math.min(redis.call('zcard', KEYS[3]), 1000)  -- WAKE_MAX
    redis.call('del', KEYS[7])
    for _ = 1, n do redis.call('rpush', KEYS[7], 1) end
    if n > 0 then redis.call('pexpire', KEYS[7], 2000) end  -- SIGNAL_TTL_MS
end

local function settle()
    if redis.call('zcard', KEYS[1]) + redis.call('zcard', KEYS[3]) == 0 then
        redis.call('del', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
        redis.call('zrem', KEYS[9], ARGV[2])
    end
end

local writer = redis.call('zrem', KEYS[5], ARGV[1])
local waited = redis.call('zrem', KEYS[3], ARGV[1])
redis.call('hdel', KEYS[4], ARGV[1])
if writer == 1 then wake() end
settle()
return waited
""")

# --- SLOT_RELEASE: compare the owner, free its slot, wake the waiters ------------------
# KEYS[1..9], ARGV[1..2]: the layout above; KEYS[10] this request's marker;
# ARGV[3] the marker's lifetime in ms.
# Returns 1 if ARGV[1] held a live slot (or an earlier run released it), else 0.
SLOT_RELEASE = LuaScript("""
local now_t = redis.call('time')
local now_ms = math.floor((tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])) / 1000)

local function wake()
    local n = math.min(redis.call('zcard', KEYS[3]), 1000)  -- WAKE_MAX
    redis.call('del', KEYS[7])
    for _ = 1, n do redis.call('rpush', KEYS[7], 1) end
    if n > 0 then redis.call('pexpire', KEYS[7], 2000) end  -- SIGNAL_TTL_MS
end

local function settle()
    if redis.call('zcard', KEYS[1]) + redis.call('zcard', KEYS[3]) == 0 then
        redis.call('del', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
        redis.call('zrem', KEYS[9], ARGV[2])
    end
end

local ends = redis.call('zscore', KEYS[1], ARGV[1])
if not ends or tonumber(ends) <= now_ms then return redis.call('exists', KEYS[10]) end
redis.call('zrem', KEYS[1], ARGV[1])
redis.call('hdel', KEYS[2], ARGV[1])
redis.call('set', KEYS[10], 1, 'PX', ARGV[3])
wake()
settle()
return 1
""")

# --- SLOT_EXTEND: compare the owner, then its lease runs ARGV[3] ms from now -----------
# KEYS[1..9], ARGV[1..2]: the layout above; ARGV[3] ttl ms.
# Returns 1 if ARGV[1] held a live slot, else 0.
SLOT_EXTEND = LuaScript("""
local now_t = redis.call('time')
local now_ms = math.floor((tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])) / 1000)

local function touch()
    local deadline = now_ms + 1
    for _, key in ipairs({KEYS[1], KEYS[3]}) do
        local last = redis.call('zrange', key, -1, -1, 'WITHSCORES')
        if last[2] then deadline = math.max(deadline, tonumber(last[2])) end
    end
    for i = 1, 6 do redis.call('pexpire', KEYS[i], deadline - now_ms) end
end

local ends = redis.call('zscore', KEYS[1], ARGV[1])
if not ends or tonumber(ends) <= now_ms then return 0 end
redis.call('zadd', KEYS[1], 'XX', now_ms + tonumber(ARGV[3]), ARGV[1])
touch()
return 1
""")

# --- SLOT_CHECK: does ARGV[1] hold a live slot? -------------------------------------------
# KEYS[1] holders zset; ARGV[1] owner token.
# Returns 1 or 0.
SLOT_CHECK = LuaScript("""
local now_t = redis.call('time')
local now_ms = math.floor((tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])) / 1000)
local ends = redis.call('zscore', KEYS[1], ARGV[1])
if ends and tonumber(ends) > now_ms then return 1 end
return 0
""")

# --- SLOT_BREAK: free the live slot with token ARGV[3] ("" : every slot) ----------------
# KEYS[1..9], ARGV[1..2]: the layout above (ARGV[1] unused); KEYS[10] the
# marker of this break request (a random id); ARGV[4] the marker's lifetime in ms.
# Returns how many slots were freed (by this run, or the earlier run of this request).
SLOT_BREAK = LuaScript("""
local done = redis.call('get', KEYS[10])
if done then return tonumber(done) end
local now_t = redis.call('time')
local now_ms = math.floor((tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])) / 1000)

local function wake()
    local n = math.min(redis.call('zcard', KEYS[3]), 1000)  -- WAKE_MAX
    redis.call('del', KEYS[7])
    for _ = 1, n do redis.call('rpush', KEYS[7], 1) end
    if n > 0 then redis.call('pexpire', KEYS[7], 2000) end  -- SIGNAL_TTL_MS
end

local function settle()
    if redis.call('zcard', KEYS[1]) + redis.call('zcard', KEYS[3]) == 0 then
        redis.call('del', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
        redis.call('zrem', KEYS[9], ARGV[2])
    end
end

local broken = 0
for _, owner in ipairs(redis.call('zrangebyscore', KEYS[1], '(' .. now_ms, '+inf')) do
    local info = redis.call('hget', KEYS[2], owner) or ''
    if ARGV[3] == '' or string.match(info, '^(%d+):') == ARGV[3] then
        redis.call('zrem', KEYS[1], owner)
        redis.call('hdel', KEYS[2], owner)
        broken = broken + 1
    end
end
redis.call('set', KEYS[10], broken, 'PX', ARGV[4])
if broken > 0 then wake() end
settle()
return broken
""")

# --- SLOT_LIST: one page of one shard's semaphores ------------------------------------------
# Up to ARGV[4] index entries in a lexicographic range, with their live
# holders and waiters; entries with neither leave the index. The keys are
# built from ARGV[3]; they carry the shard's hash tag, so they are in this slot.
# KEYS[1] index zset; ARGV[1], ARGV[2] the ZRANGEBYLEX bounds, ARGV[3] the
# key prefix "T:sem:", ARGV[4] the page size.
# Returns {now_us, next, name1, limit1, holders1, weights1, name2, ...}: next
# as LIST's (scripts.py); holders {"token:weight:acquired_us:holder JSON",
# ms left, ...}, weights the waiters' weights.
SLOT_LIST = LuaScript("""
local now_t = redis.call('time')
local now_us = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])
local now_ms = math.floor(now_us / 1000)
local page = redis.call('zrangebylex', KEYS[1], ARGV[1], ARGV[2], 'LIMIT', 0, tonumber(ARGV[4]))
local out = {string.format('%d', now_us), ''}
if #page == tonumber(ARGV[4]) then out[2] = '(' .. page[#page] end
for _, name in ipairs(page) do
    local live, key = '(' .. now_ms, ARGV[3] .. 'h:' .. name
    local holders = redis.call('zrangebyscore', key, live, '+inf', 'WITHSCORES')
    local waiters = redis.call('zrangebyscore', ARGV[3] .. 'w:' .. name, live, '+inf')
    if #holders == 0 and #waiters == 0 then
        redis.call('zrem', KEYS[1], name)
    else
        local held, weights = {}, {}
        for i = 1, #holders, 2 do
            local info = redis.call('hget', ARGV[3] .. 'i:' .. name, holders[i])
            if info then
                held[#held + 1] = info
                held[#held + 1] = tonumber(holders[i + 1]) - now_ms
            end
        end
        for _, owner in ipairs(waiters) do
            weights[#weights + 1] = redis.call('hget', ARGV[3] .. 'wi:' .. name, owner) or '1'
        end
        out[#out + 1] = name
        out[#out + 1] = redis.call('hget', ARGV[3] .. 'm:' .. name, 'limit') or '1'
        out[#out + 1] = held
        out[#out + 1] = weights
    end
end
return out
""")

# --- The parked-task queue of a semaphore: no lease, kept until unparked ---------------
# Its keys, for shard tag T and name N: KEYS[1] ``T:park:q:N`` zset (key ->
# order), KEYS[2] ``T:park:p:N`` hash (key -> "order:payload"; the order
# exactly, a zset score being a double), KEYS[3] ``T:park:idx`` index zset of
# the names with parked tasks; ARGV[1] the name N.

# --- PARK: add or replace the entry ARGV[2] with order ARGV[3] and payload ARGV[4] ------
# KEYS[1..3], ARGV[1]: the queue's layout. Returns 1.
PARK = LuaScript("""
redis.call('zadd', KEYS[1], ARGV[3], ARGV[2])
redis.call('hset', KEYS[2], ARGV[2], ARGV[3] .. ':' .. ARGV[4])
redis.call('zadd', KEYS[3], 0, ARGV[1])
return 1
""")

# --- UNPARK: remove and return the ARGV[2] entries of smallest order --------------------
# KEYS[1..3], ARGV[1]: the queue's layout; KEYS[4] this request's marker,
# which keeps the reply (JSON) for a resend; ARGV[3] its lifetime in ms.
# Returns {key1, "order1:payload1", key2, ...}, smallest order first (ties by key).
UNPARK = LuaScript("""
local done = redis.call('get', KEYS[4])
if done then return cjson.decode(done) end
local out = {}
if tonumber(ARGV[2]) > 0 then
    for _, key in ipairs(redis.call('zrange', KEYS[1], 0, tonumber(ARGV[2]) - 1)) do
        local entry = redis.call('hget', KEYS[2], key)
        redis.call('zrem', KEYS[1], key)
        redis.call('hdel', KEYS[2], key)
        if entry then
            out[#out + 1] = key
            out[#out + 1] = entry
        end
    end
end
if redis.call('zcard', KEYS[1]) == 0 then
    redis.call('del', KEYS[2])
    redis.call('zrem', KEYS[3], ARGV[1])
end
redis.call('set', KEYS[4], cjson.encode(out), 'PX', ARGV[3])
return out
""")

# --- UNPARK_KEY: remove the entry ARGV[2] ---------------------------------------------------
# KEYS[1..3], ARGV[1]: the queue's layout; KEYS[4] this request's marker;
# ARGV[3] its lifetime in ms.
# Returns 1 if the entry was there (when this request, or its earlier run, removed it), else 0.
UNPARK_KEY = LuaScript("""
if redis.call('exists', KEYS[4]) == 1 then return 1 end
local removed = redis.call('zrem', KEYS[1], ARGV[2])
redis.call('hdel', KEYS[2], ARGV[2])
if removed == 1 then redis.call('set', KEYS[4], 1, 'PX', ARGV[3]) end
if redis.call('zcard', KEYS[1]) == 0 then
    redis.call('del', KEYS[2])
    redis.call('zrem', KEYS[3], ARGV[1])
end
return removed
""")

# --- PARK_LIST: one page of one shard's parked queues --------------------------------------
# KEYS[1] the parked index zset; ARGV[1], ARGV[2] the ZRANGEBYLEX bounds,
# ARGV[3] the key prefix "T:park:", ARGV[4] the page size.
# Returns {now_us, next, name1, entries1, name2, ...}: next as LIST's
# (scripts.py), entries {key, "order:payload", ...}; empty queues leave the index.
PARK_LIST = LuaScript("""
local now_t = redis.call('time')
local page = redis.call('zrangebylex', KEYS[1], ARGV[1], ARGV[2], 'LIMIT', 0, tonumber(ARGV[4]))
local out = {now_t[1], ''}
if #page == tonumber(ARGV[4]) then out[2] = '(' .. page[#page] end
for _, name in ipairs(page) do
    local entries = redis.call('hgetall', ARGV[3] .. 'p:' .. name)
    if #entries == 0 then
        redis.call('zrem', KEYS[1], name)
    else
        out[#out + 1] = name
        out[#out + 1] = entries
    end
end
return out
""")

#: Every script, by name (the tests check their shared helpers and constants).
ALL = {
    "SLOT_ACQUIRE": SLOT_ACQUIRE,
    "SLOT_LEAVE": SLOT_LEAVE,
    "SLOT_RELEASE": SLOT_RELEASE,
    "SLOT_EXTEND": SLOT_EXTEND,
    "SLOT_CHECK": SLOT_CHECK,
    "SLOT_BREAK": SLOT_BREAK,
    "SLOT_LIST": SLOT_LIST,
    "PARK": PARK,
    "UNPARK": UNPARK,
    "UNPARK_KEY": UNPARK_KEY,
    "PARK_LIST": PARK_LIST,
}
