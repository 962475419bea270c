"""A process that holds locks while the browser test breaks one in the admin.

Run with the test project's settings. Takes the locks named on the command
line on the default (database) backend, prints one JSON line per lease, then
answers commands on stdin: ``ensure NAME`` prints ``held`` or
``LockLost: ...``. At end of input it releases what it still holds.
"""

from __future__ import annotations

import contextlib
import json
import sys
import uuid

import django


def main() -> None:
    django.setup()
    from django_dlock import DLockError, LockLost, lock

    metadata = {
        "report:daily": {"note": "nightly sales report"},
        "invoice:42": {"note": "regenerating the PDF"},
        "sync:account:7": {
            "task_name": "billing.tasks.sync_account",
            "task_id": str(uuid.UUID(int=0x5F0C1A2E_9B3D_4C7E_8A61_2F4D5E6A7B8C)),
            "worker": "celery@worker-1",
            "scope": "run",
        },
    }
    held = {}
    for name in sys.argv[1:]:
        held[name] = lock(name, ttl=60, metadata=metadata.get(name, {})).acquire()
        print(json.dumps({"name": name, "token": held[name].token}), flush=True)
    for line in sys.stdin:
        command, _, name = line.strip().partition(" ")
        if command == "ensure":
            try:
                held[name].ensure()
                print("held", flush=True)
            except LockLost as e:
                print(f"LockLost: {e}", flush=True)
    for handle in held.values():
        with contextlib.suppress(DLockError):
            handle.release()


if __name__ == "__main__":
    main()
