"""A worker process for the multi-process tests (test_multiprocess.py).

Configures Django from DLOCK_MP_CONFIG (JSON), writes its ready file, waits
for the start file (the test writes it once every worker is ready) so all
workers begin together, then runs critical sections that read-modify-write an
unguarded counter file, and writes (counter value read, fencing token) pairs.
"""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    config = json.loads(os.environ["DLOCK_MP_CONFIG"])
    import django
    from django.conf import settings

    settings.configure(
        DATABASES=config["databases"],
        INSTALLED_APPS=["django_dlock"],
        DLOCK_BACKENDS={"default": config["backend"]},
        USE_TZ=True,
    )
    django.setup()
    from django_dlock import lock

    counter_fd = os.open(config["counter"], os.O_RDWR)
    width = config["width"]

    def increment() -> int:
        value = int(os.pread(counter_fd, width, 0))
        time.sleep(config["hold"])
        os.pwrite(counter_fd, str(value + 1).zfill(width).encode(), 0)
        return value

    # Ready: the test starts every worker at once, however long the imports took.
    with open(config["ready"], "w"):
        pass
    while not os.path.exists(config["start"]):
        time.sleep(0.005)
    records: list[tuple[int, int | None]] = []
    limit = config.get("limit")
    if limit is not None:
        # A semaphore: the section counts the processes inside it in a flock'd file.
        import fcntl

        from django_dlock import semaphore

        inside_fd = os.open(config["inside"], os.O_RDWR)

        def count(step: int) -> int:
            fcntl.flock(inside_fd, fcntl.LOCK_EX)
            try:
                value = int(os.pread(inside_fd, width, 0)) + step
                os.pwrite(inside_fd, str(value).zfill(width).encode(), 0)
                return value
            finally:
                fcntl.flock(inside_fd, fcntl.LOCK_UN)

        for _ in range(config["sections"]):
            if config["use_lock"]:
                with semaphore(config["name"], limit=limit, ttl=30, timeout=300) as held:
                    inside = count(1)
                    time.sleep(config["hold"])
                    count(-1)
                records.append((inside, held.token))
            else:
                inside = count(1)
                time.sleep(config["hold"])
                count(-1)
                records.append((inside, None))
        with open(config["out"], "w") as out:
            json.dump(records, out)
        return
    for _ in range(config["sections"]):
        if config["use_lock"]:
            with lock(config["name"], ttl=30, timeout=300) as held:
                records.append((increment(), held.token))
        else:
            records.append((increment(), None))
    with open(config["out"], "w") as out:
        json.dump(records, out)


if __name__ == "__main__":
    main()
