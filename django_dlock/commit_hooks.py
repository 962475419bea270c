"""``on_commit`` callbacks that a failing hook of the application cannot skip.

Django runs a transaction's ``on_commit()`` callbacks in the order they were
registered, and stops at the first one registered without ``robust=True``
that raises:

    t0  a view registers ``on_commit(send_mail)``, then returns;
    t1  its guard registers the lock's release, to run at the commit;
    t2  the transaction commits; ``send_mail`` raises;
    t3  the release never runs: the callbacks still queued stay reachable
        from the raising frame, which the exception's traceback keeps alive
        (for good, if an error reporter keeps the exception), and the
        watchdog goes on renewing the lease.

So the package's own callbacks are registered robust and put first: they
only release locks and close connections, which the application's hooks
cannot depend on being held, and the transaction has committed by then.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def on_commit_first(connection: Any, callback: Callable[[], None]) -> None:
    """``connection.on_commit(callback, robust=True)``, run before the hooks registered earlier.

    Only inside a transaction (``connection.in_atomic_block``): outside one
    Django would call ``callback`` at once.
    """
    hooks = connection.run_on_commit
    count = len(hooks)
    connection.on_commit(callback, robust=True)
    if len(hooks) == count + 1 and connection.run_on_commit is hooks:
        hooks.insert(0, hooks.pop())


class _AtTransactionEnd:
    """An ``on_commit`` callback that calls back at the commit, or when Django drops it uncalled.

    Django drops the callbacks of a transaction that rolls back (or of a
    connection it closes); CPython frees the dropped callback at once, and
    its finalizer calls back then, inside Django's rollback: the callback
    must run no statement on that connection. Dropped with a savepoint that
    rolled back, it moves to the transaction around it.
    """

    def __init__(self, connection: Any, callback: Callable[[], None]) -> None:
        self._finalizer = weakref.finalize(self, _ended, weakref.ref(connection), callback)
        self._finalizer.atexit = False

    def __call__(self) -> None:
        self._finalizer()


def _ended(ref: weakref.ref[Any], callback: Callable[[], None]) -> None:
    connection = ref()
    if connection is not None and connection.in_atomic_block and connection.connection is not None:
        on_commit_first(connection, _AtTransactionEnd(connection, callback))
    else:
        callback()


def at_transaction_end(connection: Any, callback: Callable[[], None]) -> None:
    """``callback()`` when the transaction open on ``connection`` commits or rolls back."""
    # First: a failing on_commit hook of the application must not skip it.
    on_commit_first(connection, _AtTransactionEnd(connection, callback))
