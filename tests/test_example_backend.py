"""The example backend of docs/development.md beyond the conformance suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests.example_backend import SQLiteFileBackend

ROOT = Path(__file__).resolve().parent.parent


def test_tokens_keep_growing_after_the_file_is_lost(tmp_path: Path) -> None:
    """A lost file (a restart that lost its data) must not reissue a token."""
    path = tmp_path / "locks.sqlite3"
    before = SQLiteFileBackend("example-lost", {"LOCATION": str(path)})
    first = before.acquire("x", renew=False)
    first.release()
    second = before.acquire("x", renew=False)
    second.release()
    before.close()
    path.unlink()
    after = SQLiteFileBackend("example-lost", {"LOCATION": str(path)})
    third = after.acquire("x", renew=False)
    third.release()
    after.close()
    assert first.token < second.token < third.token


class Summary(str):
    """pytest's last line, with the reasons of the skipped tests (``-ra``)."""

    skips: list[str]


def run_the_suite(arguments: list[str], at_least: int) -> Summary:
    """``python -m django_dlock.testing *arguments``, as a user runs it; its summary line."""
    command = [sys.executable, "-m", "django_dlock.testing", *arguments, "-q", "-p", "no:logging"]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO_", "PYTEST_", "DLOCK_TEST_"))
    }
    run = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None, summary
    assert int(passed.group(1)) >= at_least, summary
    assert "failed" not in summary and "error" not in summary, summary
    result = Summary(summary)
    result.skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    return result


@pytest.mark.multiprocess
def test_the_shipped_conformance_suite_passes_on_it(tmp_path: Path) -> None:
    """docs/development.md's one command: ``python -m django_dlock.testing`` on the example."""
    run_the_suite(
        [
            "--backend", "tests.example_backend.SQLiteFileBackend",
            "--location", str(tmp_path / "locks.sqlite3"),
            "-x",
        ],
        at_least=50,
    )  # fmt: skip


@pytest.mark.multiprocess
def test_a_backend_on_django_s_database_runs_it_with_database() -> None:
    """``--database``: our own database backend, on PostgreSQL, through the runner."""
    if "postgresql" not in settings.DATABASES:
        pytest.skip(settings.UNAVAILABLE_BACKENDS["db-postgresql"])
    server = settings.DATABASES["postgresql"]
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "postgres",
        "HOST": server["HOST"],
        "PORT": server["PORT"],
        "USER": server["USER"],
        "PASSWORD": server["PASSWORD"],
        "TEST": {"NAME": f"test_dlock_runner_{os.getpid()}"},
    }
    summary = run_the_suite(
        [
            "--backend", "django_dlock.backends.database.DatabaseBackend",
            "--database", json.dumps(database),
            "-k", "test_conformance or test_lease_kinds",
        ],
        at_least=40,
    )  # fmt: skip
    # Semaphores included: nothing skipped but the tests of other backends of
    # ours and of backends without semaphores.
    expected = ("django-dlock's own backends", "the backend has semaphores")
    assert all(any(e in r for e in expected) for r in summary.skips), summary.skips


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "the backend is missing"),
        (["--backend", "no.such.Backend"], "cannot be imported"),
        (["--backend", "os.path.join"], "is not a lock backend"),
        (
            ["--backend", "django_dlock.backends.locmem.LocMemBackend", "--location", "[x"],
            "not a JSON list",
        ),
        (["--backend", "django_dlock.backends.locmem.LocMemBackend", "--options", "[]"], "object"),
        (["--backend", "django_dlock.backends.database.DatabaseBackend"], "--database"),
        (
            [
                "--backend",
                "django_dlock.backends.database.DatabaseBackend",
                "--database",
                '{"NAME": "x"}',
            ],
            "ENGINE",
        ),
    ],
)
def test_the_runner_refuses_bad_arguments_before_any_test(
    arguments: list[str], message: str
) -> None:
    """A usage error (exit 2) naming what is wrong, not a run of failing tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DLOCK_TEST_"))}
    run = subprocess.run(
        [sys.executable, "-m", "django_dlock.testing", *arguments],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert message in run.stderr, run.stderr
    assert "passed" not in run.stdout and "Traceback" not in run.stderr


@pytest.mark.multiprocess
def test_with_a_sqlite_database_the_processes_share_its_test_database(tmp_path: Path) -> None:
    """Second review of issue 30: Django's default SQLite test database is in memory.

    The multi-process test's workers could not open it ("no such table").
    """
    database = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "db.sqlite3")}
    run_the_suite(
        [
            "--backend", "django_dlock.backends.database.DatabaseBackend",
            "--database", json.dumps(database),
            "-k", "test_eight_processes_lose_no_updates",
        ],
        at_least=1,
    )  # fmt: skip
