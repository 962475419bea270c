"""Signals sent by django-dlock.

Every signal is sent with ``sender`` = the backend class and these keyword
arguments: ``backend`` (alias), ``name`` and ``token``; the handle-based ones
also pass ``held`` (the :class:`~django_dlock.held.HeldLock`).

- ``lock_acquired``: a lease was granted, or adopted (``adopt()`` of a
  ticket). Also ``waited`` (seconds from the start of the acquisition to the
  grant; 0 for an adopted lease), ``contended`` (the lock service refused it
  at least once first) and ``adopted``.
- ``lock_released``: its holder released it. Also ``held_for``: seconds since
  the grant.
- ``lock_lost``: a holder found out its lease is gone (renewal refused or
  failed until the lease ran out, or ``ensure()`` saw it gone). Sent once per
  handle. Also ``reason`` and ``held_for``.
- ``lock_detached``: its holder handed it over with ``detach()`` (the
  adopting process sends ``lock_acquired`` for it, with ``waited`` 0). Also
  ``held_for``.
- ``lock_timeout``: an acquisition gave up because its deadline passed while
  others held the lock (it is about to raise ``LockTimeout``; a one-shot try,
  ``timeout=0``, counts). No ``token`` or ``held``; ``timeout`` (the
  acquisition's, 0 for a one-shot try), ``waited`` (seconds) and ``template``
  (the key template of the name, or None) instead.

- ``lock_broken``: an operator broke a lease with ``break_lock()``, the
  ``locks break`` command or the admin; ``token`` is the fencing token of the
  lease broken when the breaker named it (the command and the admin always
  do), else None.

A handle's ``template`` attribute is the key template its name was made from
(by ``@lock``, ``@locked_task`` or a guarded view), or None: what
``django_dlock.contrib.prometheus`` labels its metrics by instead of the name.

``task_skipped`` is sent by ``django_dlock.celery`` and ``django_dlock.task_framework``
(Django's task framework) when a locked task call is skipped because its lock
is held (``on_locked="skip"``), with ``sender`` = the task class and ``task``
(the task), ``task_id``, ``name`` (the lock key), ``backend``, ``scope``
(``"run"``: the body did not run; ``"queue"``: the message was not sent, or
the task not enqueued), ``args``, ``kwargs``, ``template`` (the task's key
template, else ``"<task name>:*"``) and ``holder`` (the holder metadata of the
lease that made it skip, None if it cannot be told).

``task_deferred`` is sent by ``django_dlock.celery`` when a call of a task
with ``on_locked="defer"`` was parked (its message is acknowledged; it will be
sent again when a slot frees), with the same arguments as ``task_skipped``
less ``scope``.

``watchdog_lagging`` is sent once when a process's watchdog falls behind
renewing the leases of one backend (renewals going out more than a sixth of
their TTL late, or leases running out before their renewal could be sent),
with ``sender`` = the backend class, ``backend``,
``late`` (seconds), ``waiting`` (leases queued for renewal) and ``lost``
(leases that ran out waiting so far). It is sent again only after a minute
without a late renewal.

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

lock_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
lock_timeout = Signal()
lock_detached = Signal()
lock_broken = Signal()
task_skipped = Signal()
task_deferred = Signal()
watchdog_lagging = Signal()
