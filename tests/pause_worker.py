"""Process A of the pause scenario (tests/test_fencing.py).

Configures Django from DLOCK_PAUSE_CONFIG (JSON), acquires the lock with a
short TTL and prints its token, then waits for the go file. The test stops
this process with SIGSTOP meanwhile, so the lease runs out, and process B
acquires and writes. After SIGCONT, A tries its fenced save and ``ensure()``
and prints what happened to each.
"""

from __future__ import annotations

import json
import os
import sys
import time


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
    from django_dlock import LockLost, StaleWrite, lock
    from tests.models import Document

    held = lock(config["name"], ttl=config["ttl"]).acquire()
    print(json.dumps({"token": held.token}), flush=True)
    while not os.path.exists(config["go"]):
        time.sleep(0.01)
    outcome = {}
    doc = Document.objects.using(config["database"]).get(pk=config["pk"])
    doc.body = "written by A"
    try:
        doc.save(fencing_token=held.token, using=config["database"])
        outcome["save"] = "saved"
    except StaleWrite as e:
        outcome["save"] = f"StaleWrite: {e}"
    try:
        held.ensure()
        outcome["ensure"] = "held"
    except LockLost as e:
        outcome["ensure"] = f"LockLost: {e}"
    print(json.dumps(outcome), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
