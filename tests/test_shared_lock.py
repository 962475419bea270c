"""One Lock object shared by threads that acquire different names through it."""

from __future__ import annotations

import sys
import threading
import time

from django_dlock import lock, locks


def test_threads_sharing_one_lock_object_lose_no_handle(name: str) -> None:
    """Each thread's acquire(name=...) returns its handle; no lease is left that nobody holds.

    The Lock remembers its handles in a set that every acquire prunes; pruned
    while another thread added to it, acquire() raised after the lease was
    granted ("Set changed size during iteration"), and that lease stayed held.
    """
    shared = lock(name, ttl=30, backend="locmem")
    errors: list[BaseException] = []
    stop = time.monotonic() + 3

    def run(i: int) -> None:
        while time.monotonic() < stop and not errors:
            try:
                # Several handles each, so that the set is long to iterate.
                for k in range(4):
                    shared.acquire(name=f"{name}:{i}:{k}")
                for _ in range(4):
                    shared.release()
            except BaseException as e:
                errors.append(e)
                return

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors[0]
    assert locks["locmem"].list(name) == []
