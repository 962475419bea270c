"""The Redis backend's Lua scripts: one literal per script, its contract above it.

Each script runs atomically on the server. They are sent as ``EVALSHA`` and
loaded again after ``NOSCRIPT`` (a restart, ``SCRIPT FLUSH``); see
``connections.Node.run``. The queue's machinery (``grant``, ``live_head``,
``hand_off``) is written out in every script that needs it, so that each one
reads on its own; ``tests/test_redis.py`` checks that the copies agree.

The lock scripts ACQUIRE, RELEASE, BREAK and ABANDON share one key layout:
KEYS[1] lock, KEYS[2] fence hash, KEYS[3] index zset, KEYS[4] queue list
(waiter ids in arrival order), KEYS[5] queue deadlines zset (waiter -> ms by
the server clock), KEYS[6] queue info hash (waiter -> "ttl_ms:holder JSON"),
KEYS[7] "someone waits" flag, KEYS[8] wake list; and the same first ARGVs:
ARGV[1] owner token (also the waiter id), ARGV[2] ttl ms, ARGV[3] lock name,
ARGV[4] holder JSON, ARGV[5] waiter lease ms, ARGV[6] signal key prefix,
ARGV[7] "1" to join the queue when refused (fair mode, or a waiter that has
waited too long in unfair mode).

The queue gives first come, first served: while it has a live waiter, nobody
else may take the lock, and a release hands the lock straight to the first
live waiter, so it is never idle between holders; so does a refused attempt
that finds the lock free (a lease ran out) and another waiter first in line.
The waiter is granted min(its ttl, HANDOVER_LEASE_MS), which bounds the stall
if it died or stopped in the last moments before its turn, and its watchdog
extends that to its full TTL. The grant is announced on the waiter's signal
list as "token:granted_us:lease_ms". Without the queue (the unfair fast path)
a refused caller sets the "someone waits" flag and a release pushes one
element to the wake list for a blocked waiter to take.

Both are also published on a channel named like the wake list (KEYS[8]):
a hand-over as "waiter:token:granted_us:lease_ms", a wake-up as "". A
process's asyncio waiters on a lock share one subscription to it and one
KEEP call a second instead of a connection each (``waiters.py``).

Retries (a socket timeout, a connection lost after the command was sent; our
client resends once, a Cluster or django-redis client by its own policy) may
run a script twice. RELEASE and BREAK change what the next run sees, so a
successful run leaves a short-lived marker that makes the repeat answer as
the first did: t0 RELEASE runs, t1 its reply is lost, t2 the resent RELEASE
finds the lock no longer ours but the marker there, and answers 1 instead of
reporting the lease lost (or, in fair mode, BREAK breaking the waiter it had
just handed the lock to).

Constants the scripts use are written into them as numbers, each marked with a
``-- NAME`` comment; ``tests/test_redis.py`` checks they match the ones below.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

#: A fair waiter that has not re-checked for this long is presumed dead and
#: dropped from the queue; an unfair waiter's "someone waits" flag lasts as
#: long. Must exceed WAIT_CAP (backend.py) comfortably. Sent as ARGV[5].
WAITER_LEASE_MS = 3000
#: A queued waiter handed the lock gets min(its TTL, this) until its watchdog
#: extends the lease (at a third of it). A waiter stopped (SIGSTOP, a VM
#: pause) just as it is handed the lock holds everyone else up this long; not
#: above WAIT_CAP, so that every waiter behind it has re-checked by then and
#: wakes when it ends (issue 16: 3 s, the waiter lease, before).
HANDOVER_LEASE_MS = 1000
#: How long a wake-up element survives if nobody pops it.
SIGNAL_TTL_MS = 2000


@dataclass(frozen=True)
class LuaScript:
    """A script's text and its SHA1, the name ``EVALSHA`` calls it by."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


# --- ACQUIRE: one attempt, one round trip ---------------------------------------------
# KEYS[1..8], ARGV[1..7]: the lock scripts' layout (module docstring).
# Grants when the lock is free and nobody is queued (or the caller is the
# live head of the queue): the token is max(last + 1, server clock in us),
# the counter is advanced, the value "owner:token:acquired_us:holder JSON" is
# written with SET NX PX and the name indexed. A lock that is free while
# another live waiter is first in line (a lease ran out: nobody released it)
# is handed to that waiter here, so the queue moves on although the waiter
# due may be stopped.
# Returns the new fencing token (> 0); {token, PTTL} if ARGV[1] holds the lock
# already (a retry after a lost reply, or a hand-over it has not seen yet);
# when refused, -(holder's PTTL + 1), or {-(PTTL + 1), server time in us} if
# the caller is (now) queued.
ACQUIRE = LuaScript("""
local current = redis.call('get', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
    return {tonumber(string.match(current, '^[^:]*:(%d+):')), redis.call('pttl', KEYS[1])}
end

local now_t = redis.call('time')
local now_us = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])

local function grant(owner, ttl_ms, holder)
    local token = math.max(tonumber(redis.call('hget', KEYS[2], ARGV[3]) or 0) + 1, now_us)
    local token_s = string.format('%d', token)
    local value = owner .. ':' .. token_s .. ':' .. string.format('%d', now_us) ..
        ':' .. holder
    redis.call('set', KEYS[1], value, 'NX', 'PX', ttl_ms)
    redis.call('hset', KEYS[2], ARGV[3], token_s)
    redis.call('zadd', KEYS[3], 0, ARGV[3])
    return token
end

if not current and redis.call('exists', KEYS[4]) == 0 then
    return grant(ARGV[1], ARGV[2], ARGV[4])  -- nobody queued: the fast path
end

-- The queue's machinery, defined only past the fast path (defining Lua
-- functions costs on every call).
local function live_head()
    local now_ms = math.floor(now_us / 1000)
    while true do
        local head = redis.call('lindex', KEYS[4], 0)
        if not head then return false end
        local deadline = redis.call('zscore', KEYS[5], head)
        if deadline and tonumber(deadline) > now_ms then return head end
        redis.call('lpop', KEYS[4])
        redis.call('zrem', KEYS[5], head)
        redis.call('hdel', KEYS[6], head)
    end
end

local function hand_off()
    while true do
        local head = live_head()
        if not head then return false end
        redis.call('lpop', KEYS[4])
        redis.call('zrem', KEYS[5], head)
        local info = redis.call('hget', KEYS[6], head)
        redis.call('hdel', KEYS[6], head)
        if info then
            local sep = string.find(info, ':', 1, true)
            -- HANDOVER_LEASE_MS:
            local lease = math.min(tonumber(string.sub(info, 1, sep - 1)), 1000)
            local token = grant(head, lease, string.sub(info, sep + 1))
            local sig = ARGV[6] .. head
            local signal = string.format('%d', token) .. ':' .. string.format('%d', now_us) ..
                ':' .. lease
            redis.call('rpush', sig, signal)
            redis.call('pexpire', sig, 2000)  -- SIGNAL_TTL_MS
            redis.call('publish', KEYS[8], head .. ':' .. signal)
            return true
        end
    end
end

local function enqueue()
    local lease = tonumber(ARGV[5])
    if redis.call('zadd', KEYS[5], math.floor(now_us / 1000) + lease, ARGV[1]) == 1 then
        redis.call('rpush', KEYS[4], ARGV[1])
        redis.call('hset', KEYS[6], ARGV[1], ARGV[2] .. ':' .. ARGV[4])
    end
    for i = 4, 6 do redis.call('pexpire', KEYS[i], 2 * lease) end
end

local head = live_head()
local pttl = redis.call('pttl', KEYS[1])
if pttl == -2 and (not head or head == ARGV[1]) then
    if head then
        redis.call('lpop', KEYS[4])
        redis.call('zrem', KEYS[5], ARGV[1])
        redis.call('hdel', KEYS[6], ARGV[1])
    end
    return grant(ARGV[1], ARGV[2], ARGV[4])
end
if pttl == -2 and hand_off() then
    pttl = redis.call('pttl', KEYS[1])
end
if ARGV[7] == '1' then
    enqueue()
    return {-(math.max(pttl, 0) + 1), string.format('%d', now_us)}
end
redis.call('set', KEYS[7], 1, 'PX', ARGV[5])
return -(math.max(pttl, 0) + 1)
""")

# --- RELEASE: compare the owner, delete, drop the index entry, pass the lock on ---------
# KEYS[1..8], ARGV[1..7]: the lock scripts' layout (ARGV[2], ARGV[4] unused);
# KEYS[9] this release request's marker; ARGV[8] the marker's lifetime in ms.
# Passing on: the first live queued waiter is handed the lock, or else one
# unfair waiter that flagged it waits is woken.
# Returns 1 if ARGV[1] held the lock (or an earlier run released it), else 0.
RELEASE = LuaScript("""
local value = redis.call('get', KEYS[1])
if not value or string.sub(value, 1, #ARGV[1] + 1) ~= ARGV[1] .. ':' then
    return redis.call('exists', KEYS[9])
end
redis.call('del', KEYS[1])
redis.call('zrem', KEYS[3], ARGV[3])
redis.call('set', KEYS[9], 1, 'PX', ARGV[8])

if redis.call('exists', KEYS[4]) == 1 then
    local now_t = redis.call('time')
    local now_us = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])

    local function grant(owner, ttl_ms, holder)
        local token = math.max(tonumber(redis.call('hget', KEYS[2], ARGV[3]) or 0) + 1, now_us)
        local token_s = string.format('%d', token)
        local value = owner .. ':' .. token_s .. ':' .. string.format('%d', now_us) ..
            ':' .. holder
        redis.call('set', KEYS[1], value, 'NX', 'PX', ttl_ms)
        redis.call('hset', KEYS[2], ARGV[3], token_s)
        redis.call('zadd', KEYS[3], 0, ARGV[3])
        return token
    end

    local function live_head()
        local now_ms = math.floor(now_us / 1000)
        while true do
            local head = redis.call('lindex', KEYS[4], 0)
            if not head then return false end
            local deadline = redis.call('zscore', KEYS[5], head)
            if deadline and tonumber(deadline) > now_ms then return head end
            redis.call('lpop', KEYS[4])
            redis.call('zrem', KEYS[5], head)
            redis.call('hdel', KEYS[6], head)
        end
    end

    local function hand_off()
        while true do
            local head = live_head()
            if not head then return false end
            redis.call('lpop', KEYS[4])
            redis.call('zrem', KEYS[5], head)
            local info = redis.call('hget', KEYS[6], head)
            redis.call('hdel', KEYS[6], head)
            if info then
                local sep = string.find(info, ':', 1, true)
                -- HANDOVER_LEASE_MS:
                local lease = math.min(tonumber(string.sub(info, 1, sep - 1)), 1000)
                local token = grant(head, lease, string.sub(info, sep + 1))
                local sig = ARGV[6] .. head
                local signal = string.format('%d', token) .. ':' .. string.format('%d', now_us) ..
                    ':' .. lease
                redis.call('rpush', sig, signal)
                redis.call('pexpire', sig, 2000)  -- SIGNAL_TTL_MS
                redis.call('publish', KEYS[8], head .. ':' .. signal)
                return true
            end
        end
    end

    if hand_off() then return 1 end
end

if redis.call('exists', KEYS[7]) == 1 then
    if redis.call('llen', KEYS[8]) == 0 then redis.call('rpush', KEYS[8], 1) end
    redis.call('pexpire', KEYS[8], 2000)  -- SIGNAL_TTL_MS
    redis.call('publish', KEYS[8], '')
end
return 1
""")

# --- BREAK: delete whoever holds it and pass the lock on as RELEASE does ---------------
# KEYS[1..8], ARGV[1..7]: the lock scripts' layout (only ARGV[3] and ARGV[6]
# used); KEYS[9] the marker of this break request (a random id);
# ARGV[8] "" breaks any holder; a fencing token breaks only the lease with
# that token, or with ARGV[9] = "le" (Redlock, where each master numbers a
# lease on its own and the caller knows the largest) one numbered no higher;
# ARGV[10] the marker's lifetime in ms.
# Returns 1 if a lease was deleted (by this or an earlier run), else 0.
BREAK = LuaScript("""
if redis.call('exists', KEYS[9]) == 1 then return 1 end
local value = redis.call('get', KEYS[1])
if not value then
    redis.call('zrem', KEYS[3], ARGV[3])
    return 0
end
if ARGV[8] ~= '' then
    local token = tonumber(string.match(value, '^[^:]*:(%d+):'))
    local wanted = tonumber(ARGV[8])
    if token ~= wanted and not (ARGV[9] == 'le' and token < wanted) then return 0 end
end
redis.call('del', KEYS[1])
redis.call('zrem', KEYS[3], ARGV[3])
redis.call('set', KEYS[9], 1, 'PX', ARGV[10])

if redis.call('exists', KEYS[4]) == 1 then
    local now_t = redis.call('time')
    local now_us = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])

    local function grant(owner, ttl_ms, holder)
        local token = math.max(tonumber(redis.call('hget', KEYS[2], ARGV[3]) or 0) + 1, now_us)
        local token_s = string.format('%d', token)
        local value = owner .. ':' .. token_s .. ':' .. string.format('%d', now_us) ..
            ':' .. holder
        redis.call('set', KEYS[1], value, 'NX', 'PX', ttl_ms)
        redis.call('hset', KEYS[2], ARGV[3], token_s)
        redis.call('zadd', KEYS[3], 0, ARGV[3])
        return token
    end

    local function live_head()
        local now_ms = math.floor(now_us / 1000)
        while true do
            local head = redis.call('lindex', KEYS[4], 0)
            if not head then return false end
            local deadline = redis.call('zscore', KEYS[5], head)
            if deadline and tonumber(deadline) > now_ms then return head end
            redis.call('lpop', KEYS[4])
            redis.call('zrem', KEYS[5], head)
            redis.call('hdel', KEYS[6], head)
        end
    end

    local function hand_off()
        while true do
            local head = live_head()
            if not head then return false end
            redis.call('lpop', KEYS[4])
            redis.call('zrem', KEYS[5], head)
            local info = redis.call('hget', KEYS[6], head)
            redis.call('hdel', KEYS[6], head)
            if info then
                local sep = string.find(info, ':', 1, true)
                -- HANDOVER_LEASE_MS:
                local lease = math.min(tonumber(string.sub(info, 1, sep - 1)), 1000)
                local token = grant(head, lease, string.sub(info, sep + 1))
                local sig = ARGV[6] .. head
                local signal = string.format('%d', token) .. ':' .. string.format('%d', now_us) ..
                    ':' .. lease
                redis.call('rpush', sig, signal)
                redis.call('pexpire', sig, 2000)  -- SIGNAL_TTL_MS
                redis.call('publish', KEYS[8], head .. ':' .. signal)
                return true
            end
        end
    end

    if hand_off() then return 1 end
end

if redis.call('exists', KEYS[7]) == 1 then
    if redis.call('llen', KEYS[8]) == 0 then redis.call('rpush', KEYS[8], 1) end
    redis.call('pexpire', KEYS[8], 2000)  -- SIGNAL_TTL_MS
    redis.call('publish', KEYS[8], '')
end
return 1
""")

# --- ABANDON: a queued waiter gives up ---------------------------------------------------
# If it was handed the lock meanwhile, it releases it; it leaves the queue;
# and if the lock is free the turn passes on (to the next live waiter, or an
# unfair waiter is woken), so the queue does not stall.
# KEYS[1..8], ARGV[1..7]: the lock scripts' layout (ARGV[2], ARGV[4] unused);
# KEYS[9] the waiter's signal list.
# Returns 1 if the waiter had been handed the lock, else 0.
ABANDON = LuaScript("""
local now_t = redis.call('time')
local now_us = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])

local function grant(owner, ttl_ms, holder)
    local token = math.max(tonumber(redis.call('hget', KEYS[2], ARGV[3]) or 0) + 1, now_us)
    local token_s = string.format('%d', token)
    local value = owner .. ':' .. token_s .. ':' .. string.format('%d', now_us) ..
        ':' .. holder
    redis.call('set', KEYS[1], value, 'NX', 'PX', ttl_ms)
    redis.call('hset', KEYS[2], ARGV[3], token_s)
    redis.call('zadd', KEYS[3], 0, ARGV[3])
    return token
end

local function live_head()
    local now_ms = math.floor(now_us / 1000)
    while true do
        local head = redis.call('lindex', KEYS[4], 0)
        if not head then return false end
        local deadline = redis.call('zscore', KEYS[5], head)
        if deadline and tonumber(deadline) > now_ms then return head end
        redis.call('lpop', KEYS[4])
        redis.call('zrem', KEYS[5], head)
        redis.call('hdel', KEYS[6], head)
    end
end

local function hand_off()
    while true do
        local head = live_head()
        if not head then return false end
        redis.call('lpop', KEYS[4])
        redis.call('zrem', KEYS[5], head)
        local info = redis.call('hget', KEYS[6], head)
        redis.call('hdel', KEYS[6], head)
        if info then
            local sep = string.find(info, ':', 1, true)
            -- HANDOVER_LEASE_MS:
            local lease = math.min(tonumber(string.sub(info, 1, sep - 1)), 1000)
            local token = grant(head, lease, string.sub(info, sep + 1))
            local sig = ARGV[6] .. head
            local signal = string.format('%d', token) .. ':' .. string.format('%d', now_us) ..
                ':' .. lease
            redis.call('rpush', sig, signal)
            redis.call('pexpire', sig, 2000)  -- SIGNAL_TTL_MS
            redis.call('publish', KEYS[8], head .. ':' .. signal)
            return true
        end
    end
end

local granted = 0
local value = redis.call('get', KEYS[1])
if value and string.sub(value, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
    redis.call('del', KEYS[1])
    redis.call('zrem', KEYS[3], ARGV[3])
    granted = 1
end
redis.call('lrem', KEYS[4], 0, ARGV[1])
redis.call('zrem', KEYS[5], ARGV[1])
redis.call('hdel', KEYS[6], ARGV[1])
redis.call('del', KEYS[9])
if redis.call('exists', KEYS[1]) == 0 and not hand_off() then
    if redis.call('exists', KEYS[7]) == 1 then
        if redis.call('llen', KEYS[8]) == 0 then redis.call('rpush', KEYS[8], 1) end
        redis.call('pexpire', KEYS[8], 2000)  -- SIGNAL_TTL_MS
        redis.call('publish', KEYS[8], '')
    end
end
return granted
""")

# --- KEEP: a process's queued waiters on one lock are alive ---------------------------------
# Their queue deadlines are moved WAITER_LEASE_MS on, as their own ACQUIRE would
# move them, in one call for all of them (waiters.py).
# KEYS[1] lock, KEYS[2] queue list, KEYS[3] queue deadlines zset, KEYS[4] queue
# info hash (KEYS[1], [4], [5], [6] of the lock scripts); ARGV[1] waiter lease
# ms, ARGV[2..] waiter ids.
# Returns {the lock's PTTL (-2: free), the ids no longer queued...}: those were
# handed the lock, or dropped as dead, or left.
KEEP = LuaScript("""
local now_t = redis.call('time')
local deadline = math.floor((tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])) / 1000) +
    tonumber(ARGV[1])
local out = {redis.call('pttl', KEYS[1])}
for i = 2, #ARGV do
    if redis.call('zscore', KEYS[3], ARGV[i]) then
        redis.call('zadd', KEYS[3], deadline, ARGV[i])
    else
        out[#out + 1] = ARGV[i]
    end
end
if redis.call('exists', KEYS[2]) == 1 then
    for i = 2, 4 do redis.call('pexpire', KEYS[i], 2 * tonumber(ARGV[1])) end
end
return out
""")

# --- EXTEND: compare the owner, then the lease runs ARGV[2] ms from now -----------------
# KEYS[1] lock; ARGV[1] owner token, ARGV[2] ttl ms
# Returns 1 if ARGV[1] held the lock, else 0.
EXTEND = LuaScript("""
local value = redis.call('get', KEYS[1])
if not value or string.sub(value, 1, #ARGV[1] + 1) ~= ARGV[1] .. ':' then return 0 end
redis.call('pexpire', KEYS[1], ARGV[2])
return 1
""")

# --- EXTEND_MANY: EXTEND for each lease of one shard, in one round trip -----------------
# The watchdog's batched renewal. The keys share the shard's hash tag, so a
# Cluster runs the script on the master of that slot.
# KEYS[i] lock of lease i; ARGV[2i - 1] its owner token, ARGV[2i] its ttl ms
# Returns a list: at i, 1 if ARGV[2i - 1] held KEYS[i] (extended), else 0.
EXTEND_MANY = LuaScript("""
local out = {}
for i, key in ipairs(KEYS) do
    local owner = ARGV[2 * i - 1]
    local value = redis.call('get', key)
    if value and string.sub(value, 1, #owner + 1) == owner .. ':' then
        redis.call('pexpire', key, ARGV[2 * i])
        out[i] = 1
    else
        out[i] = 0
    end
end
return out
""")

# --- ADOPT: move a handed-over lease from the ticket's owner to the adopter -------------
# The lease keeps its token and runs ARGV[3] ms from now. Once moved, the
# ticket's owner no longer matches, so a second adoption is refused; a retry
# by the same adopter (its reply was lost) finds the lease its own.
# KEYS[1] lock; ARGV[1] owner in the ticket, ARGV[2] adopter's owner token,
# ARGV[3] ttl ms
# Returns 1 if the lease is now ARGV[2]'s, else 0.
ADOPT = LuaScript("""
local value = redis.call('get', KEYS[1])
if not value then return 0 end
if string.sub(value, 1, #ARGV[2] + 1) == ARGV[2] .. ':' then
    redis.call('pexpire', KEYS[1], ARGV[3])
    return 1
end
if string.sub(value, 1, #ARGV[1] + 1) ~= ARGV[1] .. ':' then return 0 end
redis.call('set', KEYS[1], ARGV[2] .. string.sub(value, #ARGV[1] + 1), 'PX', ARGV[3])
return 1
""")

# --- GET: the live lease on one name -------------------------------------------------------
# KEYS[1] lock
# Returns {now_us, value, pttl}: the server clock in us, the lock's value
# "owner:token:acquired_us:holder JSON" and its PTTL in ms; or {now_us} if the
# name is free or its key has no TTL (LIST skips those too).
GET = LuaScript("""
local now_t = redis.call('time')
local now_us = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])
local value = redis.call('get', KEYS[1])
if value then
    -- 0: under a millisecond left, but live (acquire still refuses).
    local pttl = redis.call('pttl', KEYS[1])
    if pttl >= 0 then return {string.format('%d', now_us), value, pttl} end
end
return {string.format('%d', now_us)}
""")

# --- LIST: one page of one shard ---------------------------------------------------------
# Up to ARGV[4] index entries in a lexicographic range whose lock is still
# live, dropping entries whose lease expired. The lock keys are built from
# ARGV[3]; they carry the shard's hash tag, so they are in this slot. Pages
# keep each call short: a script blocks the server.
# KEYS[1] index zset; ARGV[1], ARGV[2] the ZRANGEBYLEX bounds, ARGV[3] the
# lock key prefix "{tag}:lock:", ARGV[4] the page size
# Returns {now_us, next, name1, token1, acquired_us1, holder1, pttl1, name2, ...}:
# the fields of each lock's value "owner:token:acquired_us:holder JSON" but
# the owner, split here so that the client reads whole columns (a value not
# in that shape, written by hand, comes back as token 0, acquired 0 and the
# whole value as its holder). next is the lower bound of the next page
# ("(" .. last name), or "" after the last page.
LIST = LuaScript("""
local now_t = redis.call('time')
local now_us = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])
local page = redis.call('zrangebylex', KEYS[1], ARGV[1], ARGV[2], 'LIMIT', 0, tonumber(ARGV[4]))
local out = {string.format('%d', now_us), ''}
if #page == tonumber(ARGV[4]) then out[2] = '(' .. page[#page] end
for _, name in ipairs(page) do
    local key = ARGV[3] .. name
    local value = redis.call('get', key)
    if not value then
        redis.call('zrem', KEYS[1], name)
    else
        -- 0: under a millisecond left, but live (acquire still refuses).
        local pttl = redis.call('pttl', key)
        if pttl >= 0 then
            local token, acquired, holder = string.match(value, '^[^:]*:(%d+):(%d+):(.*)$')
            local n = #out
            out[n + 1] = name
            out[n + 2] = token or '0'
            out[n + 3] = acquired or '0'
            out[n + 4] = holder or value
            out[n + 5] = pttl
        end
    end
end
return out
""")


def lock_key(tag: str, name: str) -> str:
    """The key of lease ``name`` in the shard of hash tag ``tag`` (name "": the keys' prefix)."""
    return f"{tag}:lock:{name}"


@dataclass(frozen=True)
class Keys:
    """The keys of one lock name, in the layout above (all with its shard's hash tag)."""

    lock: str
    fence: str
    index: str
    wake: str
    waiting: str
    queue: str
    queue_deadlines: str
    queue_info: str
    signal_prefix: str
    done_prefix: str


#: Every script, by the name the module docstring's table uses.
ALL = {
    "ACQUIRE": ACQUIRE,
    "RELEASE": RELEASE,
    "BREAK": BREAK,
    "ABANDON": ABANDON,
    "KEEP": KEEP,
    "EXTEND": EXTEND,
    "EXTEND_MANY": EXTEND_MANY,
    "ADOPT": ADOPT,
    "GET": GET,
    "LIST": LIST,
}
