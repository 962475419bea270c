"""`make release-check`: the distributions as a user gets them, installed from wheels only.

1. Builds the sdist and the wheel into dist/ and runs `twine check --strict`.
2. Checks what the sdist holds: the package, its licence, README and
   changelog, and no tests (docs/development.md: the suite needs the
   repository).
3. For each interpreter and Django pair below (3.10 + 4.2, 3.12 + 6.0,
   3.13 + 5.2, and 3.12 + 6.1, what an unpinned install resolves today), in
   a fresh virtualenv: installs the wheel with every extra from wheels only
   (`pip install --only-binary :all:`: a dependency that needs a compiler
   fails here, not on a user's machine), makes a project with `django-admin
   startproject`, adds django_dlock and a small app, and runs `migrate`,
   `check`, a lock, a locked Celery task (eager) and a locked task of
   Django's task framework (django.tasks on Django 6, the django-tasks
   package before it, on its ImmediateBackend).

Usage: python scripts/release_check.py [--keep] [--only 3.12]
Exit 0 when every step passed; the first failure prints its output and exits 1.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (Python, Django, extras). The health extra (django-health-check 4.x) needs
# Django 5.2 or later, so Django 4.2 gets every other one.
EXTRAS = "all,redis,etcd,zookeeper,celery,tasks,prometheus,opentelemetry,testing"
PAIRS = [
    ("3.10", "4.2", EXTRAS),
    ("3.12", "6.0", EXTRAS + ",health"),
    ("3.13", "5.2", EXTRAS + ",health"),
    # What an unpinned install gets today (Django 6.1): not in the classifiers
    # until the suite runs on it, but it must install, migrate and lock.
    ("3.12", "6.1", EXTRAS + ",health"),
]

SMOKE_JOBS = '''\
"""A locked Celery task and a locked task of Django's task framework."""

from django_dlock.celery import locked_task
from django_dlock.task_framework import locked_task as framework_task


@locked_task(key="celery-job:{n}", bind=True)
def celery_job(self, n):
    return {"n": n, "token": self.lock.token}


@framework_task(key="framework-job:{n}")
def framework_job(n):
    from django_dlock.task_framework import current_lock

    return {"n": n, "token": current_lock().token}
'''

SMOKE_RUN = '''\
"""Run inside the project: a lock, a Celery task (eager) and a task-framework task."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "smoke.settings")

import django

django.setup()

from celery import Celery

from django_dlock import LockTimeout, lock, locks

app = Celery("smoke", set_as_current=True)
app.conf.task_always_eager = True

from jobs import celery_job, framework_job  # noqa: E402  (after the app)

with lock("release-check", ttl=10, timeout=5) as held:
    assert held.token > 0, held.token
    try:
        with lock("release-check", timeout=0):
            raise AssertionError("the lock was taken twice")
    except LockTimeout:
        pass
    [info] = locks["default"].list("release-check")
    assert info.token == held.token
assert locks["default"].get("release-check") is None

result = celery_job.delay(7)
assert result.successful(), result.traceback
assert result.result["n"] == 7 and result.result["token"] > 0, result.result

task_result = framework_job.enqueue(8)
assert task_result.return_value["n"] == 8, task_result.return_value
assert task_result.return_value["token"] > 0

import django_dlock.backends.etcd  # noqa: E402,F401  (the etcd extra's gRPC stubs import)
import django_dlock.backends.zookeeper  # noqa: E402,F401  (the zookeeper extra: kazoo)

print("smoke: ok")
'''

SMOKE_SETTINGS = """

# --- added by scripts/release_check.py ---
INSTALLED_APPS += ["django_dlock"]
try:
    import django.tasks  # noqa: F401  (Django 6)
    TASKS = {"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}}
except ImportError:
    INSTALLED_APPS += ["django_tasks"]
    TASKS = {"default": {"BACKEND": "django_tasks.backends.immediate.ImmediateBackend"}}
"""


def interpreter(version: str) -> str:
    """A python of ``version``: pyenv's, else python3.X on PATH."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
    if found:
        return found[-1]
    on_path = shutil.which(f"python{version}")
    if on_path:
        return on_path
    sys.exit(f"release-check: no Python {version} (pyenv or python{version} on PATH)")


def run(what: str, command: list[str], **kwargs: object) -> str:
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    took = time.monotonic() - started
    if done.returncode != 0:
        print(f"release-check: FAILED: {what} ({took:.0f} s)\n$ {' '.join(command)}")
        print(done.stdout[-8000:], done.stderr[-8000:], sep="\n")
        sys.exit(1)
    print(f"  ok  {what} ({took:.0f} s)")
    return str(done.stdout)


def build(dist: Path) -> tuple[Path, Path]:
    shutil.rmtree(dist, ignore_errors=True)
    run(
        "build the sdist and the wheel",
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
    )
    [sdist] = dist.glob("*.tar.gz")
    [wheel] = dist.glob("*.whl")
    run(
        "twine check --strict",
        [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
    )
    return sdist, wheel


def check_sdist(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    for needed in (
        "CHANGELOG.md",
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "django_dlock/__init__.py",
    ):
        if needed not in names:
            sys.exit(f"release-check: FAILED: the sdist lacks {needed}")
    stray = [n for n in names if n.startswith(("tests/", "testproject/", "benchmarks/", "chaos/"))]
    if stray:
        sys.exit(
            "release-check: FAILED: the sdist ships what cannot run without the "
            f"repository: {stray[:5]}"
        )
    print(
        "  ok  the sdist holds the package, LICENSE, README and CHANGELOG, and no tests "
        f"({len(names)} files)"
    )


def check_wheel(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
    for needed in ("django_dlock/py.typed", "django_dlock/migrations/0001_initial.py"):
        if needed not in names:
            sys.exit(f"release-check: FAILED: the wheel lacks {needed}")
    if not any(n.startswith("django_dlock/templates/") for n in names):
        sys.exit("release-check: FAILED: the wheel lacks the admin templates")
    print(f"  ok  the wheel holds py.typed, the migrations and the templates ({len(names)} files)")


def smoke(python: str, django: str, extras: str, wheel: Path, work: Path) -> None:
    venv = work / "venv"
    run(f"venv on {python}", [python, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    run(
        "pip up to date",
        [*pip, "install", "--quiet", "--only-binary", ":all:", "--upgrade", "pip"],
    )
    run(
        f"install the wheel [{extras}] with Django {django}.*, from wheels only",
        [
            *pip,
            "install",
            "--quiet",
            "--only-binary",
            ":all:",
            f"{wheel}[{extras}]",
            f"Django=={django}.*",
        ],
    )
    bindir = venv / "bin"
    project = work / "project"
    project.mkdir()
    run(
        "django-admin startproject",
        [str(bindir / "django-admin"), "startproject", "smoke", str(project)],
    )
    with open(project / "smoke" / "settings.py", "a") as settings:
        settings.write(SMOKE_SETTINGS)
    (project / "jobs.py").write_text(SMOKE_JOBS)
    (project / "run_smoke.py").write_text(SMOKE_RUN)
    python_bin = str(bindir / "python")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    run(
        "manage.py migrate",
        [python_bin, "manage.py", "migrate", "--noinput"],
        cwd=project,
        env=env,
    )
    run(
        "manage.py check",
        [python_bin, "manage.py", "check", "--fail-level", "WARNING"],
        cwd=project,
        env=env,
    )
    run(
        "a lock, a locked Celery task (eager), a locked task-framework task",
        [python_bin, "run_smoke.py"],
        cwd=project,
        env=env,
    )
    versions = run(
        "versions",
        [
            python_bin,
            "-c",
            "import sys, django, django_dlock.backends.etcd; "
            "print(sys.version.split()[0], django.get_version())",
        ],
        cwd=project,
        env=env,
    )
    probe = subprocess.run([python_bin, "-c", "import etcd3"], capture_output=True)
    if probe.returncode == 0:
        sys.exit(
            "release-check: FAILED: etcd3 is installed; the etcd extra should need "
            "only grpcio and protobuf"
        )
    print(f"  ok  Python and Django: {versions.strip()}; no etcd3 installed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--keep", action="store_true", help="keep the virtualenvs and projects")
    parser.add_argument("--only", help="only the pairs of this Python version (3.10, 3.12, 3.13)")
    options = parser.parse_args()
    started = time.monotonic()
    print("release-check: build")
    sdist, wheel = build(ROOT / "dist")
    check_sdist(sdist)
    check_wheel(wheel)
    work = Path(tempfile.mkdtemp(prefix="dlock-release-check-"))
    try:
        for version, django, extras in PAIRS:
            if options.only and options.only != version:
                continue
            print(f"release-check: Python {version} + Django {django}")
            pair = work / f"py{version}-django{django}"
            pair.mkdir()
            smoke(interpreter(version), django, extras, wheel, pair)
    finally:
        if options.keep:
            print(f"release-check: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"release-check: passed in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
