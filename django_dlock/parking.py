"""Calls parked by ``@locked_task(on_locked="defer")``, and sending them again.

The parked calls live in the lock service (the backend's ``do_park`` queue of
each key), so they outlive the worker that parked them. This module does not
import Celery (only kombu's JSON, which Celery's ``json`` serializer uses):
``app`` is the Celery app, used only for ``send_task``.

In run scope, a call that finds no free
slot parks itself on the lock service (``do_park``: its task, arguments,
routing and its place in line) and its message is acknowledged with
``Ignore`` (its result is not recorded: the deferred run records it under the
same task id). Then it tries once more: a run that ended between the refusal
and the parking popped nobody, so the slot it freed is taken here (and the
parked entry removed) instead of being lost. Every run that ends pops the
oldest parked call of its key and sends it again with the same task id; a
call sent again that finds the slots taken by a newcomer parks again at its
old place. A worker that starts (``worker_ready``) re-sends parked calls of
keys with free slots, for slots freed by leases that ran out (a killed
worker), and looks again when the earliest such lease ends.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kombu.utils import json as kombu_json

from .handler import locks

__all__ = ["ORDER_HEADER", "header", "park_payload", "send_parked", "send_parked_calls"]

logger = logging.getLogger("django_dlock.celery")

#: Message header of a deferred call sent again: its place in line (µs).
ORDER_HEADER = "django_dlock_order"


def header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def park_payload(
    task: str, args: Any, kwargs: Any, delivery: Any, order: int, limit: int | None
) -> str:
    """The JSON text that sends a parked call of ``task`` again, to where it was routed."""
    try:
        return str(
            kombu_json.dumps(  # type: ignore[no-untyped-call]
                {
                    "task": task,
                    "args": list(args),
                    "kwargs": dict(kwargs),
                    "exchange": delivery.get("exchange"),
                    "routing_key": delivery.get("routing_key"),
                    "priority": delivery.get("priority"),
                    "order": order,
                    "limit": limit,
                }
            )
        )
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"on_locked='defer' keeps the arguments of {task} as JSON in the lock "
            f"service (kombu's, as Celery's json serializer), and these are not "
            f"JSON-serializable: {e}"
        ) from e


def send_parked(app: Any, alias: str, key: str, count: int) -> int:
    """Pop up to ``count`` calls parked on ``key`` and send them again; return how many."""
    try:
        backend = locks[alias]
        parked = backend.do_unpark(key, count)
    except Exception:
        logger.warning("Could not unpark the calls deferred on %r", key, exc_info=True)
        return 0
    sent = 0
    for entry in parked:
        try:
            data = kombu_json.loads(entry.payload)  # type: ignore[no-untyped-call]
            routing = {k: data[k] for k in ("exchange", "routing_key", "priority") if data.get(k)}
            app.send_task(
                data["task"],
                args=data["args"],
                kwargs=data["kwargs"],
                task_id=entry.key,
                headers={ORDER_HEADER: entry.order},
                **routing,
            )
            sent += 1
        except Exception:
            # Parked again at its place rather than lost.
            logger.warning("Could not send the deferred call %s again", entry.key, exc_info=True)
            try:
                backend.do_park(key, entry.key, entry.order, entry.payload)
            except Exception:
                logger.error("Lost the deferred call %s on %r", entry.key, key, exc_info=True)
    return sent


def send_parked_calls(app: Any, alias: str | None = None) -> tuple[int, float | None]:
    """Send again the calls parked on keys that have a free slot now.

    Returns how many were sent, and in how many seconds the earliest lease
    ends that holds a slot some parked call waits for (None: none does). Runs
    when a worker starts: slots freed by leases that ran out (a killed
    worker) wake nobody, so the parked calls of such keys would otherwise
    wait for the next run of their key to end.
    """
    aliases = {alias} if alias else set()
    if not aliases:
        for task in list(app.tasks.values()):
            options = getattr(task, "lock_options", None)
            if options is not None and getattr(options, "on_locked", None) == "defer":
                aliases.add(options.backend)
    sent, wake_in = 0, None
    for name in sorted(aliases):
        backend = locks[name]
        limits: dict[str, int | None] = {}
        for parked in backend.do_list_parked(""):
            try:
                limits[parked.name] = json.loads(parked.payload).get("limit")
            except (TypeError, ValueError, AttributeError):
                limits.setdefault(parked.name, None)
        for key, limit in sorted(limits.items()):
            if isinstance(limit, int) and backend.supports_semaphores:
                holders = [h for i in backend.semaphores(key) if i.name == key for h in i.holders]
            else:  # a mutex (a task without limit)
                one = backend.get(key)
                limit, holders = 1, ([] if one is None else [one])
            free = limit - len(holders)
            if free > 0:
                sent += send_parked(app, name, key, free)
            elif holders:
                ends = min(h.expires_in for h in holders)
                wake_in = ends if wake_in is None else min(wake_in, ends)
    return sent, wake_in
