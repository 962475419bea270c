"""Calls parked by ``@locked_task(on_locked="defer")``, and sending them again.

The parked calls live in the lock service (the backend's parking queue of
each key), so they outlive the worker that parked them. Parking is a part of
the Celery integration, not of the lock-service contract: a backend has it
when it declares ``supports_parking`` (:func:`has_parking`), and
:func:`park`, :func:`unpark` and :func:`unpark_key` are the only ways in,
each refusing a backend without it with an error that names the alias.
``manage.py check`` reports a deferring task on such a backend at startup
(``django_dlock.E011``). This module does not import Celery (only kombu's
JSON, which Celery's ``json`` serializer uses): ``app`` is the Celery app,
used only for ``send_task``.

In run scope, a call that finds no free
slot parks itself on the lock service (``do_park``: its task, arguments,
routing and its place in line) and its message is acknowledged with
``Ignore`` (its result is not recorded: the deferred run records it under the
same task id). Then it tries once more: a run that ended between the refusal
and the parking popped nobody, so the slot it freed is taken here (and the
parked entry removed) instead of being lost. Every run that ends pops the
oldest parked call of its key and sends it again with the same task id; a
call sent again that finds the slots taken by a newcomer parks again at its
old place. A worker, from its start (``worker_ready``) to its shutdown, and
a process that parks a call, re-send parked calls of keys with free slots,
for slots freed by leases that ran out (a killed worker), and look again when
the earliest lease blocking a parked call ends (:func:`look_for_parked`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from kombu.utils import json as kombu_json

from .._validation import validate_name
from ..backends.base import BaseLockBackend, ParkedTask
from ..backends.parking_backend import ParkingBackend
from ..backends.semaphore_backend import SemaphoreBackend
from ..exceptions import LockConfigurationError
from ..handler import locks

# The parking queue's public face; django_dlock.celery uses the rest.
__all__ = [
    "ORDER_HEADER",
    "NoParking",
    "has_parking",
    "park",
    "send_parked_calls",
    "unpark",
    "unpark_key",
]

logger = logging.getLogger("django_dlock.celery")

#: Message header of a deferred call sent again: its place in line (µs).
ORDER_HEADER = "django_dlock_order"


class NoParking(LockConfigurationError):
    """A lock backend without a parking queue asked to park or unpark a call."""

    check_id = "django_dlock.E011"


def has_parking(backend: BaseLockBackend) -> bool:
    """Whether ``backend`` has a parking queue for deferred calls (a :class:`ParkingBackend`)."""
    return isinstance(backend, ParkingBackend)


def _parking(alias: str) -> ParkingBackend:
    backend = locks[alias]
    if not isinstance(backend, ParkingBackend):
        raise NoParking(
            f"Lock backend {alias!r} ({backend.path}) has no parking queue: "
            "on_locked='defer' cannot park calls there.",
            alias=alias,
        )
    return backend


def park(alias: str, name: str, key: str, order: int, payload: str) -> None:
    """Park the call ``key`` on ``name`` in backend ``alias``'s queue, at place ``order``.

    A call parked under ``key`` already is replaced, keeping one entry per
    call. The entry stays until unparked (it has no lease). ``payload`` is
    what sends it again (:func:`park_payload`). Raises :class:`NoParking`
    for a backend without a parking queue.
    """
    if isinstance(order, bool) or not isinstance(order, int) or order not in ORDER_RANGE:
        raise ValueError(f"order must be an int of 64 bits, not {order!r}.")
    name, key = validate_name(name), _checked_key(key)
    call_of(payload)  # one that could never be sent again is refused here, not parked
    _parking(alias).do_park(name, key, order, payload)


def unpark(alias: str, name: str, count: int) -> list[ParkedTask]:
    """Remove and return up to ``count`` calls parked on ``name``, the lowest ``order`` first."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, not {count!r}.")
    return _parking(alias).do_unpark(validate_name(name), count)


def unpark_key(alias: str, name: str, key: str) -> bool:
    """Remove the call ``key`` parked on ``name``; True if it was there."""
    return _parking(alias).do_unpark_key(validate_name(name), _checked_key(key))


#: The longest key of a parked call (a task id, with its retries and nesting).
MAX_KEY_LENGTH = 255


def _checked_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"A parked call's key must be a non-empty str, not {key!r}.")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(
            f"A parked call's key must be at most {MAX_KEY_LENGTH} characters, not {len(key)}."
        )
    return validate_name(key, what="A parked call's key")


def call_of(payload: object) -> dict[str, Any]:
    """The call ``payload`` (:func:`park_payload`'s JSON) sends again; ValueError if none.

    A JSON object with the task's name (a str), ``args`` (a list) and
    ``kwargs`` (an object).
    """
    if not isinstance(payload, str):
        raise TypeError(f"payload must be a str, not {type(payload).__name__}.")
    try:
        data = kombu_json.loads(payload)  # type: ignore[no-untyped-call]
    except ValueError as e:
        raise ValueError(f"A parked call's payload must be JSON: {e}") from None
    if not (
        isinstance(data, dict)
        and isinstance(data.get("task"), str)
        and data["task"]
        and isinstance(data.get("args"), list)
        and isinstance(data.get("kwargs"), dict)
    ):
        raise ValueError(
            "A parked call's payload must be a JSON object with the task's name ('task'), "
            f"'args' (a list) and 'kwargs' (an object), as park_payload() makes: {payload[:200]!r}"
        )
    return data


#: ``order`` is stored as a signed 64-bit integer (a database column, a sorted-set score).
ORDER_RANGE = range(-(2**63), 2**63)


def header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


#: What a call sent again keeps of its request, besides its routing: where
#: its result goes (``reply_to``: the rpc:// result backend answers there)
#: and the canvas it belongs to.
KEPT = ("reply_to", "group_id", "group_index", "root_id", "parent_id")


def park_payload(
    task: str,
    args: Any,
    kwargs: Any,
    delivery: Any,
    order: int,
    limit: int | None,
    request: Any = None,
) -> str:
    """The JSON text that sends a parked call of ``task`` again, to where it was routed."""
    kept = {k: getattr(request, k, None) for k in KEPT}
    if request is not None:
        kept["task_id"] = getattr(request, "id", None)
        kept["delivery"] = delivery_of(request)
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
                    **{k: v for k, v in kept.items() if v is not None},
                }
            )
        )
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"on_locked='defer' keeps the arguments of {task} as JSON in the lock "
            f"service (kombu's, as Celery's json serializer), and these are not "
            f"JSON-serializable: {e}"
        ) from e


def delivery_of(request: Any) -> list[int]:
    """What tells one message of a task id from another: its retries and replace nesting.

    A copy of a message (delivered again under ``acks_late`` or a broker's
    visibility timeout) has the same; a ``retry()`` counts one more retry, and
    a ``replace()`` one more nesting, under the same task id.
    """
    return [
        int(getattr(request, "retries", 0) or 0),
        int(getattr(request, "replaced_task_nesting", 0) or 0),
    ]


def parked_key(task_id: str, request: Any) -> str:
    """What a call is parked under: its task id, and its retries and nesting if any.

    Two deliveries of one message park under one key (the second replaces the
    first); a retry or a replacement, under another.
    """
    retries, nesting = delivery_of(request)
    return task_id if not (retries or nesting) else f"{task_id}:retry{retries}:replaced{nesting}"


def drop_copies(alias: str, key: str, task_id: str, request: Any) -> bool:
    """Unpark a copy of the message that just ran on ``key``; True if there was one.

    Called after the run released its slot: a copy delivered again while the
    run went on (``acks_late``, a broker's visibility timeout) found the slot
    held and was parked. The run is done, so the copy must not run again. A
    retry or a replacement of the run, parked under the same task id, has
    another parked key and stays.
    """
    try:
        dropped = unpark_key(alias, key, parked_key(task_id, request))
    except Exception:
        logger.warning("Could not look for copies of %s parked on %r", task_id, key, exc_info=True)
        return False
    if dropped:
        logger.info("Dropped the copy of %s parked on %r while it ran: it is done.", task_id, key)
    return dropped


def send_parked(app: Any, alias: str, key: str, count: int) -> int:
    """Pop up to ``count`` calls parked on ``key`` and send them again; return how many.

    An entry that can never be sent (not :func:`park_payload`'s JSON: parked
    by hand, or by another version) is dropped with an ERROR that shows it,
    and the next one popped in its place: parked again at its place, it would
    take every free slot's turn for good.
    """
    return _send(app, alias, key, _pop_sendable(alias, key, count))


def _pop_sendable(alias: str, key: str, count: int) -> list[tuple[ParkedTask, dict[str, Any]]]:
    """Up to ``count`` calls popped from ``key``'s queue, each with its decoded call."""
    popped: list[tuple[ParkedTask, dict[str, Any]]] = []
    while len(popped) < count:  # each round removes an entry, or ends
        try:
            parked = unpark(alias, key, count - len(popped))
        except Exception:
            logger.warning("Could not unpark the calls deferred on %r", key, exc_info=True)
            break
        if not parked:
            break
        for entry in parked:
            try:
                popped.append((entry, call_of(entry.payload)))
            except (TypeError, ValueError) as e:
                logger.error(
                    "Dropped the call %s parked on %r: it cannot be sent: %s", entry.key, key, e
                )
    return popped


def _send(app: Any, alias: str, key: str, popped: list[tuple[ParkedTask, dict[str, Any]]]) -> int:
    sent = 0
    for entry, data in popped:
        try:
            routing = {k: data[k] for k in ("exchange", "routing_key", "priority") if data.get(k)}
            routing.update({k: data[k] for k in KEPT if data.get(k) is not None})
            retries, nesting = data.get("delivery") or (0, 0)
            if retries or nesting:
                routing.update(retries=retries, replaced_task_nesting=nesting)
            app.send_task(
                data["task"],
                args=data["args"],
                kwargs=data["kwargs"],
                task_id=data.get("task_id") or entry.key,
                headers={ORDER_HEADER: entry.order},
                **routing,
            )
            sent += 1
        except Exception:
            # Parked again at its place rather than lost.
            logger.warning("Could not send the deferred call %s again", entry.key, exc_info=True)
            try:
                park(alias, key, entry.key, entry.order, entry.payload)
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
        backend = _parking(name)
        limits: dict[str, int | None] = {}
        for parked in backend.do_list_parked(""):
            try:
                limits[parked.name] = json.loads(parked.payload).get("limit")
            except (TypeError, ValueError, AttributeError):
                limits.setdefault(parked.name, None)
        for key, limit in sorted(limits.items()):
            if isinstance(limit, int) and isinstance(backend, SemaphoreBackend):
                info = backend.semaphore(key)  # this one semaphore: no listing by prefix
                holders = [] if info is None else list(info.holders)
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


#: The shortest wait between two looks for parked calls, seconds: a lease
#: whose end has passed may still be listed for a moment (etcd frees expired
#: leases up to about half a second late and rounds what is left of a lease
#: down to whole seconds).
LOOK_AGAIN_AFTER = 0.5
#: After a look that failed (the lock service down), seconds.
LOOK_AFTER_ERROR = 30.0
#: A worker looks this often, seconds, when no parked call waits on a lease it
#: knows of: a call parked by another worker that was then killed wakes nobody.
LOOK_IDLE = 10.0

_looks = threading.Lock()
_next_look: threading.Timer | None = None
_asked = False  # asked for while a look was under way: it may have missed the call
_keep = False  # a worker's chain: it goes on while the worker runs


def _forget_looks() -> None:  # a forked child has none of its parent's threads
    global _next_look, _keep
    _next_look, _keep = None, False


os.register_at_fork(after_in_child=_forget_looks)


def stop_looking() -> None:
    """End this process's chain of looks (a worker shutting down)."""
    global _next_look, _keep
    with _looks:
        _keep = False
        if _next_look is not None:
            _next_look.cancel()
            _next_look = None


def look_for_parked(app: Any, delay: float = 0.0, keep: bool = False) -> None:
    """Look for parked calls to send in ``delay`` s, and go on looking while any waits.

    One chain of looks per process. Each look sends the parked calls of keys
    with free slots, and the next comes when the earliest lease blocking a
    parked call ends; the chain stops when no parked call waits on a held
    slot, and starts again when a call is parked (or a worker starts). So a
    holder that dies without ending its run (kill -9, the OOM killer), whose
    run would have popped the next call, strands nobody: its slot is seen
    free when its lease ends, however many looks that takes. ``keep`` (a
    worker): go on looking every :data:`LOOK_IDLE` seconds while nothing
    waits, until :func:`stop_looking`, for calls parked by a worker that was
    killed since (it took its chain with it).
    """
    global _next_look, _asked, _keep
    with _looks:
        _keep = _keep or keep
        if _next_look is not None and _next_look.is_alive():
            _asked = True
            return
        _next_look = threading.Timer(delay, _look, args=(app,))
        _next_look.daemon = True
        _next_look.name = "django-dlock-parked-calls"
        _next_look.start()


def _look(app: Any) -> None:
    global _next_look, _asked
    with _looks:
        _asked = False
    try:
        sent, wake_in = send_parked_calls(app)
    except Exception:
        logger.warning("Could not look for deferred calls to send; looking again", exc_info=True)
        sent, wake_in = 0, LOOK_AFTER_ERROR
    if sent:
        logger.info("Sent again %d deferred call(s) whose slots are free.", sent)
    with _looks:
        _next_look = None
        if _asked and wake_in is None:
            wake_in = 0.0
        if _keep and (wake_in is None or wake_in > LOOK_IDLE):
            wake_in = LOOK_IDLE - LOOK_AGAIN_AFTER
    if wake_in is not None:
        look_for_parked(app, max(wake_in, 0.0) + LOOK_AGAIN_AFTER)
