"""The Redis backends: one round trip per operation, fenced, woken on release.

Settings::

    "BACKEND": "django_dlock.backends.redis.RedisBackend",
    "LOCATION": "redis://:password@127.0.0.1:6379/0",   # or rediss://, unix://
    "OPTIONS": {"fair": True},

``django_dlock.backends.redis.RedlockBackend`` takes a list of URLs of
independent masters instead: Redlock (see ``docs/backends/redis.md`` for what
that does and does not guarantee); a list on ``RedisBackend`` is a settings
error (E006). ``OPTIONS``:

- ``fair``: serve waiters first come, first served (default False; not Redlock).
- ``cluster``: ``LOCATION`` is a node of a Redis Cluster (default False; not Redlock).
- ``connection``: ``"django-redis:<cache alias>"`` reuses that cache's
  connection pool instead of ``LOCATION`` (not Redlock).
- ``shards``: how many hash slots the index is spread over (default 1; 16
  with ``cluster``).
- ``socket_timeout``, ``socket_connect_timeout``: seconds (default 5 and 2).
- ``client_kwargs``: more keyword arguments for the redis-py client (TLS
  files, ``username``, ``password``, ...): those its connection class takes
  (``options.py``), not the two timeouts above.

Key layout, for ``KEY_PREFIX`` P, shard s (``crc32(name) % shards``) and lock
name N. Every key of a shard carries the hash tag ``{Pdlock:s}``, so a lock's
keys always share one Redis Cluster slot::

    {Pdlock:s}:lock:N     string  "owner:token:acquired_us:holder JSON"; SET NX PX: the lease
    {Pdlock:s}:fence      hash    N -> last fencing token issued (never expires)
    {Pdlock:s}:idx        zset    N with score 0: the index that list() reads by prefix
    {Pdlock:s}:waiting:N  string  set by a refused attempt: someone waits (not fair)
    {Pdlock:s}:wake:N     list    a release pushes one element: wakes one waiter (not fair)
    {Pdlock:s}:q:N        list    queued waiters' owner tokens in arrival order
    {Pdlock:s}:qt:N       zset    queued waiter -> deadline in ms by the server clock
    {Pdlock:s}:qi:N       hash    queued waiter -> "ttl_ms:holder JSON", for the hand-over
    {Pdlock:s}:sig:W      list    where queued waiter W learns it was handed the lock
    {Pdlock:s}:done:O:n   string  set for a few seconds when owner O's release request n
                                  ran, so a resent RELEASE answers as the first did
    {Pdlock:s}:done:break:R       the same for BREAK request R (a random id)

Semaphores and read/write locks (``{Pdlock:s}:sem:...``) and parked tasks
(``{Pdlock:s}:park:...``) have keys of their own under the same tag; see
``slot_scripts.py`` and ``docs/backends/redis.md``.

Waiters queue from their first refusal with ``fair``, and otherwise once they
have waited STARVE_AFTER; see ``docs/backends/redis.md``.

So ``redis-cli GET '{dlock:0}:lock:report:daily'`` shows who holds
``report:daily`` with which token, and ``redis-cli PTTL`` for how much longer.

Fencing tokens are ``max(previous + 1, server clock in microseconds)``, so a
Redis restarted without its data (or with an older snapshot) still issues
tokens larger than any it issued before, as long as fewer than one token per
microsecond was issued for a name on average.

Modules: ``scripts`` (the Lua scripts), ``connections`` (a server's
connections), ``listing`` (reading leases back), ``aio`` (the asyncio path),
``waiters`` (the asyncio waiters' shared subscription and keeper), ``backend``
(RedisBackend), ``redlock`` (RedlockBackend), ``semaphores`` and
``slot_scripts`` (semaphores, read/write locks and parked tasks).
"""

try:
    import redis  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "The Redis lock backend needs redis-py: pip install 'django-dlock[redis]'"
    ) from e

# The public API is the backends named in DLOCK_BACKENDS (__all__, docs/api.rst).
# The other names stay importable here, as the tests and docs/backends/redis.md
# use them, but are the implementation's.
from .backend import STARVE_AFTER as STARVE_AFTER
from .backend import WAIT_CAP as WAIT_CAP
from .backend import RedisBackend
from .backend import RedisLocks as RedisLocks
from .redlock import RedlockBackend
from .scripts import HANDOVER_LEASE_MS as HANDOVER_LEASE_MS
from .scripts import SIGNAL_TTL_MS as SIGNAL_TTL_MS
from .scripts import WAITER_LEASE_MS as WAITER_LEASE_MS

__all__ = ["RedisBackend", "RedlockBackend"]
