"""The native asyncio path: a single server talked to from the event loop itself.

A single server needs no routing or quorum, so the awaitable primitives of
``RedisBackend`` use redis.asyncio there instead of running the sync ones in
a worker thread. A Cluster, a django-redis pool and Redlock keep the worker
thread (``native_async`` is False).

Waiting takes no connection here (``waiters.py``), so the pool serves only
short commands; ten thousand tasks may send one at once, and wait for a
free connection rather than fail, as redis-py's asyncio pool does once its
100 connections are out.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import Any

import redis.asyncio
from redis.exceptions import NoScriptError

from .scripts import LuaScript
from .waiters import Keep, Notifier


class AsyncNode:
    """One server for the event loops of a process: a redis.asyncio client per loop.

    Clients are bound to the loop they were made in, so each running loop
    gets its own, dropped once the loop is closed (see ``_drop_closed``).
    Commands go out at most one per
    free connection of its pool (less the subscription's): a command never
    waits inside the pool, so the moment it is sent is the moment its
    connection is ours, which the hand-over's lease is counted from.
    """

    def __init__(self, location: str, client_kwargs: Callable[[], dict[str, Any]]) -> None:
        self.location = location
        self._client_kwargs = client_kwargs
        self._clients: weakref.WeakKeyDictionary[Any, tuple[Any, asyncio.Semaphore]] = (
            weakref.WeakKeyDictionary()
        )
        self._notifiers: weakref.WeakKeyDictionary[Any, Notifier] = weakref.WeakKeyDictionary()

    def _client(self) -> tuple[Any, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        found = self._clients.get(loop)
        if found is None:
            self._drop_closed()
            kwargs = {"timeout": None, **self._client_kwargs()}
            if kwargs["timeout"] is None:
                kwargs["timeout"] = kwargs.get("socket_timeout")
            pool = redis.asyncio.BlockingConnectionPool.from_url(self.location, **kwargs)
            slots = asyncio.Semaphore(max(1, pool.max_connections - 1))
            found = self._clients[loop] = (redis.asyncio.Redis(connection_pool=pool), slots)
        return found

    def _drop_closed(self) -> None:
        """Forget the clients (and notifiers) of event loops that are closed.

        A client's connections refer to its loop, so the weak key alone
        never lets a loop go: each ``asyncio.run()`` or ``async_to_sync()``
        from a thread without a loop (a new loop each call) left a client
        and its connection open for good. Dropped, they are garbage, and
        the collector closes their sockets.
        """
        for loop in [loop for loop in list(self._clients) if loop.is_closed()]:
            self._clients.pop(loop, None)
            self._notifiers.pop(loop, None)

    def client(self) -> Any:
        """This event loop's client."""
        return self._client()[0]

    def notifier(self, channel: Callable[[str], str], keep: Keep) -> Notifier:
        """This event loop's notifier of waiters (waiters.py)."""
        loop = asyncio.get_running_loop()
        notifier = self._notifiers.get(loop)
        if notifier is None:
            notifier = self._notifiers[loop] = Notifier(self.client(), channel, keep)
        return notifier

    async def run(self, script: LuaScript, keys: list[Any], args: list[Any]) -> Any:
        """``script`` by EVALSHA, loaded again after NOSCRIPT (a restart, SCRIPT FLUSH)."""
        return (await self.run_timed(script, keys, args))[1]

    async def run_timed(
        self, script: LuaScript, keys: list[Any], args: list[Any]
    ) -> tuple[float, Any]:
        """:meth:`run`, and when (our clock) it was sent: once a connection was free."""
        client, slots = self._client()
        async with slots:
            sent = time.monotonic()
            try:
                return sent, await client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                await client.script_load(script.text)
                return sent, await client.evalsha(script.sha, len(keys), *keys, *args)

    async def get(self, key: str) -> Any:
        client, slots = self._client()
        async with slots:
            return await client.get(key)
