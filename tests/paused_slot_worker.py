"""A semaphore holder that stops itself (SIGSTOP) inside its own transaction (issue 28).

Configures Django from DLOCK_PAUSED_CONFIG (JSON: databases, backend), then
acquires ``semaphore(name, limit=1)``; the first statement after the counter
row is locked (the one deleting ended slots) is followed by a SIGSTOP of this
very process, so the transaction stays open with the row locked, as a holder
paused there by the OS, a debugger or a VM would leave it. It prints
"paused" first.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def main() -> None:
    config = json.loads(os.environ["DLOCK_PAUSED_CONFIG"])
    import django
    from django.conf import settings

    settings.configure(
        DATABASES=config["databases"],
        INSTALLED_APPS=["django.contrib.contenttypes", "django_dlock", "tests"],
        DLOCK_BACKENDS={"default": config["backend"]},
        USE_TZ=True,
    )
    django.setup()
    from django.db.backends import utils

    from django_dlock import semaphore

    execute = utils.CursorWrapper.execute

    def pausing(self: utils.CursorWrapper, sql: str, params: object = None) -> object:
        result = execute(self, sql, params)
        if "DELETE" in sql and "expires_at_us <=" in sql:
            print("paused", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return result

    utils.CursorWrapper.execute = pausing  # type: ignore[method-assign]
    with semaphore(sys.argv[1], limit=1, timeout=10):
        print("acquired", flush=True)


if __name__ == "__main__":
    main()
