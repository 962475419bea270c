"""The database backend under adversity: clocks, transactions, rollbacks (issue 15)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

import pytest
from django.conf import settings
from django.db import connections, transaction

from django_dlock import LockTimeout, lock, locks
from tests.models import Counter

ZONE = "America/New_York"


def _utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


@pytest.fixture
def new_york_session() -> Iterator[Callable[[str], None]]:
    """The lock connection's session in America/New_York, on a server clock we set.

    MariaDB knows named zones only once their tables are loaded, which
    ``mariadb-tzinfo-to-sql`` does (the zone file is Debian's tzdata).
    """
    zone_file = f"/usr/share/zoneinfo/{ZONE}"
    tool = shutil.which("mariadb-tzinfo-to-sql") or shutil.which("mysql_tzinfo_to_sql")
    client = shutil.which("mariadb") or shutil.which("mysql")
    missing = [what for what, found in [("tzinfo-to-sql", tool), ("client", client)] if not found]
    if missing or not os.path.exists(zone_file):
        reason = f"cannot load MariaDB's time zone tables (missing: {missing or zone_file})"
        if settings.REQUIRE_ALL:
            pytest.fail(reason)
        pytest.skip(reason)
    connection = connections["mysql"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM mysql.time_zone_name WHERE Name = %s", [ZONE])
        loaded = cursor.fetchone()[0] > 0
    if not loaded:
        db = settings.DATABASES["mysql"]
        sql = subprocess.run([tool, zone_file, ZONE], capture_output=True, check=True).stdout
        subprocess.run(
            [
                client, "-h", db["HOST"], "-P", str(db["PORT"]), "-u", db["USER"],
                *([f"-p{db['PASSWORD']}"] if db["PASSWORD"] else []), "mysql",
            ],
            input=sql,
            capture_output=True,
            check=True,
        )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("SET time_zone = %s", [ZONE])

    def at(utc: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SET timestamp = %s", [_utc(utc)])

    yield at
    with connection.cursor() as cursor:
        cursor.execute("SET timestamp = DEFAULT")
        cursor.execute("SET time_zone = DEFAULT")


@pytest.mark.backends("db-mysql")
@pytest.mark.with_default_db  # Django sets up test databases with "default" among them
def test_mariadb_leases_keep_utc_time_across_the_autumn_change(
    backend_alias: str, new_york_session: Callable[[str], None], name: str
) -> None:
    """On 2024-11-03 New York's clocks go from 01:59:59 EDT back to 01:00 EST (06:00 UTC).

    Local times from 01:00 to 02:00 happen twice. A lease judged by local
    time gains or loses an hour across the change.
    """
    at = new_york_session
    backend = locks[backend_alias]
    # A live lease: taken at 01:30 EST (06:30 UTC) for 40 minutes, so until
    # 07:10 UTC. At 07:01 UTC (02:01 EST) it still has 9 minutes.
    at("2024-11-03T06:30:00")
    live = backend.acquire(f"{name}:live", ttl=40 * 60, renew=False)
    at("2024-11-03T07:01:00")
    with pytest.raises(LockTimeout):
        backend.acquire(f"{name}:live", timeout=0)
    [info] = backend.list(f"{name}:live")
    assert round(info.expires_in) == 9 * 60
    # An expired lease: taken at 01:55 EDT (05:55 UTC) for 10 minutes, so
    # until 06:05 UTC. At 07:01 UTC it ended 56 minutes ago.
    at("2024-11-03T05:55:00")
    backend.acquire(f"{name}:stale", ttl=10 * 60, renew=False)
    at("2024-11-03T07:01:00")
    taken = backend.acquire(f"{name}:stale", timeout=0, renew=False)
    taken.release()
    at("2024-11-03T07:02:00")
    live.release()


@pytest.mark.backends("db-sqlite", "db-postgresql", "db-mysql")
@pytest.mark.with_default_db
def test_release_on_commit_keeps_a_read_modify_write_whole(backend_alias: str) -> None:
    """``with atomic(): with lock(k): read, add one, write`` from 4 threads, 40 times each.

    A lock on a connection of its own is released when the block ends, before
    the transaction commits: the next holder reads the old value, and updates
    are lost (93 and 101 of 160 were seen). ``release_on_commit=True`` holds it
    until the commit.
    """
    db = settings.CONFORMANCE_BACKENDS[backend_alias]
    counter = Counter.objects.using(db).create(value=0)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(40):
                with transaction.atomic(using=db):
                    with lock(
                        f"counter:{counter.pk}",
                        backend=backend_alias,
                        timeout=60,
                        release_on_commit=True,
                        using=db,
                    ):
                        row = Counter.objects.using(db).get(pk=counter.pk)
                        row.value += 1
                        row.save(using=db)
        except BaseException as e:
            errors.append(e)
        finally:
            connections[db].close()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert Counter.objects.using(db).get(pk=counter.pk).value == 160
    assert locks[backend_alias].list(f"counter:{counter.pk}") == []
