"""Signals sent by django-dlock, each documented below with the keyword arguments it sends.

The lock signals are sent with ``sender`` = the backend class; the task signals
with ``sender`` = the task class. Connect receivers that accept ``**kwargs``,
as Django asks of every receiver: arguments may be added.

A handle's ``template`` attribute is the key template its name was made from
(by ``@lock``, ``@locked_task`` or a guarded view), or None: what
``django_dlock.contrib.prometheus`` labels its metrics by instead of the name.

Receivers never run on the watchdog thread or a renewal thread, where a slow
one, one that raises or one that calls back into the package would hold up
renewals. A signal raised there (``lock_lost`` found by a renewal,
``watchdog_lagging``, ``lock_released`` of a release after a rollback) is
sent from ``django-dlock-signals-<alias>``, a thread per backend alias, in
the order raised; the handle's state (``lost``, ``ensure()`` raising) changed
before. A signal sent from any other thread (``ensure()``, ``release()`` in
your code) runs its receivers there and then, unless its handle still has a
signal queued: then it goes behind it. See ``django_dlock/dispatch.py``.
"""

from __future__ import annotations

from django.dispatch import Signal

__all__ = [
    "lock_acquired",
    "lock_broken",
    "lock_detached",
    "lock_lost",
    "lock_released",
    "lock_timeout",
    "task_deferred",
    "task_skipped",
    "watchdog_lagging",
]

#: A lease was granted, or adopted from a ticket (``locks[alias].adopt()``).
#: Sent with ``backend`` (the alias), ``name``, ``token`` (the fencing
#: token), ``held`` (the :class:`~django_dlock.HeldLock`), ``waited``
#: (seconds from the start of the acquisition to the grant; 0 for an adopted
#: lease), ``contended`` (True if the lock service refused it at least once
#: first) and ``adopted``.
lock_acquired = Signal()

#: Its holder released a lease. Sent with ``backend``, ``name``, ``token``,
#: ``held`` and ``held_for`` (seconds since the grant).
lock_released = Signal()

#: A holder found out its lease is gone: a renewal was refused, or failed
#: until the lease ran out, or ``ensure()`` saw it gone. Sent once per
#: handle, with ``backend``, ``name``, ``token``, ``held``, ``reason`` (text)
#: and ``held_for`` (seconds). The one to alert on: work ran, at least partly,
#: after its lease was gone.
lock_lost = Signal()

#: An acquisition gave up because its deadline passed while others held the
#: lock; it is about to raise :class:`~django_dlock.LockTimeout` (a one-shot
#: try, ``timeout=0``, counts). Sent with ``backend``, ``name``, ``timeout``
#: (the acquisition's; 0 for a one-shot try), ``waited`` (seconds) and
#: ``template`` (the key template of the name, or None); no ``token`` or ``held``.
lock_timeout = Signal()

#: Its holder handed a lease over with ``held.detach()``. Sent with
#: ``backend``, ``name``, ``token``, ``held`` and ``held_for``; the adopting
#: process then sends ``lock_acquired`` for it, with ``waited`` 0.
lock_detached = Signal()

#: An operator broke a lease with ``locks[alias].break_lock()``, the
#: ``locks break`` command or the admin. Sent with ``backend``, ``name`` and
#: ``token``: the fencing token of the lease broken when the breaker named
#: it (the command and the admin always do), else None.
lock_broken = Signal()

#: A locked task's call was skipped because its lock is held
#: (``on_locked="skip"``), by :mod:`django_dlock.celery` or
#: :mod:`django_dlock.task_framework`. Sent with ``sender`` = the task class,
#: ``task`` (the task), ``task_id``, ``name`` (the lock key), ``backend``,
#: ``scope`` (``"run"``: the body did not run; ``"queue"``: the message was
#: not sent, or the task not enqueued), ``args``, ``kwargs``, ``template``
#: (the task's key template, else ``"<task name>:*"``) and ``holder`` (the
#: holder metadata of the lease that made it skip; None if it cannot be told).
task_skipped = Signal()

#: A call of a Celery task with ``on_locked="defer"`` was parked: its message
#: is acknowledged, and it is sent again when a run of the same key ends.
#: Sent with the arguments of ``task_skipped`` but ``scope``.
task_deferred = Signal()

#: A process's watchdog fell behind renewing the leases of one backend:
#: renewals went out more than a sixth of their TTL late, or leases ran out
#: before their renewal could be sent. Sent once, and again only after a
#: minute without a late renewal, with ``sender`` = the backend class,
#: ``backend``, ``late`` (seconds), ``waiting`` (leases queued for renewal)
#: and ``lost`` (leases that ran out waiting so far).
watchdog_lagging = Signal()
