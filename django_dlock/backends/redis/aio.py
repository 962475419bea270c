"""The native asyncio path: a single server talked to from the event loop itself.

A single server needs no routing or quorum, so the awaitable primitives of
``RedisBackend`` use redis.asyncio there instead of running the sync ones in
a worker thread. A Cluster, a django-redis pool and Redlock keep the worker
thread (``native_async`` is False).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

import redis.asyncio
from redis.exceptions import NoScriptError

from .scripts import LuaScript


class AsyncNode:
    """One server for the event loops of a process: a redis.asyncio client per loop.

    Clients are bound to the loop they were made in, so each running loop
    gets its own, dropped with the loop.
    """

    def __init__(self, location: str, client_kwargs: Callable[[], dict[str, Any]]) -> None:
        self.location = location
        self._client_kwargs = client_kwargs
        self._clients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def client(self) -> Any:
        """This event loop's client."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = redis.asyncio.Redis.from_url(
                self.location, **self._client_kwargs()
            )
        return client

    async def run(self, script: LuaScript, keys: list[Any], args: list[Any]) -> Any:
        """``script`` by EVALSHA, loaded again after NOSCRIPT (a restart, SCRIPT FLUSH)."""
        client = self.client()
        try:
            return await client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(script.text)
            return await client.evalsha(script.sha, len(keys), *keys, *args)

    async def get(self, key: str) -> Any:
        return await self.client().get(key)

    async def blpop(self, key: str, timeout: float) -> Any:
        return await self.client().blpop([key], timeout)
