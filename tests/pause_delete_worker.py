"""Process A of the paused delete scenario (tests/test_fenced_writes.py).

As tests/pause_worker.py, for a delete: configures Django from
DLOCK_PAUSE_CONFIG (JSON), takes the lock with a short TTL, prints its token
and waits for the go file, while the test stops this process with SIGSTOP
past its lease and a newer holder writes the row. After SIGCONT, A tries its
delete and prints what happened.

``mode``: "by_hand" (``with lock(...)``, then ``delete(fencing_token=...)``),
"locked_delete" or "mixin" (``LockedSaveMixin.delete()``). In the last two
the lock is taken inside the delete call, so A waits in a ``lock_acquired``
receiver: between the grant and the delete, where a pause hurts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> None:
    config = json.loads(os.environ["DLOCK_PAUSE_CONFIG"])
    import django
    from django.conf import settings

    settings.configure(
        DATABASES=config["databases"],
        INSTALLED_APPS=["django.contrib.contenttypes", "django_dlock", "tests"],
        DLOCK_BACKENDS={"default": config["backend"]},
        USE_TZ=True,
    )
    django.setup()
    from django_dlock import lock
    from django_dlock.saves import locked_delete
    from django_dlock.signals import lock_acquired
    from django_dlock.watchdog import get_watchdog
    from tests.models import Document, LockedDocument

    db, mode, ttl = config["database"], config["mode"], config["ttl"]

    def pause_here(token: int) -> None:
        print(json.dumps({"token": token}), flush=True)
        while not os.path.exists(config["go"]):
            time.sleep(0.01)

    def on_acquired(token: int, held: Any, **kwargs: Any) -> None:
        # No renewal: the test stops this process at a point of its choosing,
        # not in the middle of a renewal's transaction, whose row lock would
        # hold up the newer holder's acquisition until SIGCONT. The lease
        # still runs out on the server, as a frozen watchdog lets it.
        get_watchdog().cancel(held)
        pause_here(token)

    outcome: dict[str, str] = {}
    try:
        if mode == "by_hand":
            doc = Document.objects.using(db).get(pk=config["pk"])
            with lock(config["name"], ttl=ttl, renew=False) as held:
                pause_here(held.token)
                doc.delete(fencing_token=held.token, using=db)
        elif mode == "locked_delete":
            doc = Document.objects.using(db).get(pk=config["pk"])
            lock_acquired.connect(on_acquired)
            locked_delete(doc, ttl=ttl, using=db)
        else:
            locked = LockedDocument.objects.using(db).get(pk=config["pk"])
            locked.lock_backend, locked.lock_ttl = "default", ttl
            lock_acquired.connect(on_acquired)
            locked.delete(using=db)
        outcome["delete"] = "deleted"
    except Exception as e:
        outcome["delete"] = f"{type(e).__name__}: {e}"
    print(json.dumps(outcome), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
