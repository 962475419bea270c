"""``python -m django_dlock.testing``: the conformance suite against one backend.

Usage::

    python -m django_dlock.testing --backend dotted.path.Backend \
        [--location LOCATION] [--options JSON] [--database JSON] [pytest arguments...]

The options fall back on ``DLOCK_TEST_BACKEND``, ``DLOCK_TEST_LOCATION``,
``DLOCK_TEST_OPTIONS`` and ``DLOCK_TEST_DATABASE``. The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

#: The pytest configuration of the run: none of the calling project's
#: (its pytest.ini or pyproject.toml would set its own settings module).
PYTEST_INI = """\
[pytest]
django_find_project = false
python_files = test_*.py
addopts = -ra --strict-markers
"""


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The backend's settings, and the arguments left for pytest."""
    parser = argparse.ArgumentParser(
        prog="python -m django_dlock.testing",
        description="Run django-dlock's conformance suite against one lock backend.",
        epilog="Any other argument goes to pytest (-x, -k EXPR, -n 2, ...).",
    )
    parser.add_argument(
        "--backend",
        default=os.environ.get("DLOCK_TEST_BACKEND"),
        help="the backend's dotted class (DLOCK_TEST_BACKEND)",
    )
    parser.add_argument(
        "--location",
        default=os.environ.get("DLOCK_TEST_LOCATION"),
        help="its LOCATION: a string, or a JSON list (DLOCK_TEST_LOCATION)",
    )
    parser.add_argument(
        "--options",
        default=os.environ.get("DLOCK_TEST_OPTIONS"),
        help="its OPTIONS, as a JSON object (DLOCK_TEST_OPTIONS)",
    )
    parser.add_argument(
        "--database",
        default=os.environ.get("DLOCK_TEST_DATABASE"),
        help="Django's 'default' DATABASES entry, as a JSON object, for a backend that "
        "keeps its leases in Django's database (DLOCK_TEST_DATABASE; else a SQLite file "
        "in a temporary directory, and the tests get no database access)",
    )
    args, rest = parser.parse_known_args(argv)
    if not args.backend:
        parser.error("the backend is missing: --backend dotted.path.Backend or DLOCK_TEST_BACKEND")
    parsed: dict[str, dict[str, object]] = {}
    for option in ("options", "database"):
        text = getattr(args, option)
        if not text:
            continue
        try:
            parsed[option] = json.loads(text)
        except ValueError as e:
            parser.error(f"--{option} is not JSON: {e}")
        if not isinstance(parsed[option], dict):
            parser.error(f"--{option} must be a JSON object")
    if "database" in parsed and "ENGINE" not in parsed["database"]:
        parser.error("--database needs an ENGINE, as a DATABASES entry does")
    if args.location and args.location.startswith("["):
        try:
            json.loads(args.location)
        except ValueError as e:
            parser.error(f"--location starts with '[' but is not a JSON list: {e}")
    backend = _backend_class(parser, args.backend)
    if getattr(backend, "uses_django_connections", False) and not args.database:
        parser.error(
            f"{args.backend} keeps its leases in Django's database: give that database "
            'as --database \'{"ENGINE": ..., "NAME": ...}\' (or DLOCK_TEST_DATABASE)'
        )
    return args, rest


def _backend_class(parser: argparse.ArgumentParser, dotted: str) -> type:
    """The class ``dotted`` names, or a usage error: before pytest, not in every test.

    The current directory first, as the tests import it.
    """
    from django_dlock.exceptions import InvalidBackendError
    from django_dlock.handler import backend_class

    sys.path.insert(0, os.getcwd())
    try:
        return backend_class("under_test", {"BACKEND": dotted})
    except InvalidBackendError as e:
        why = (
            "cannot be imported"
            if isinstance(e.__cause__, ImportError)
            else "is not a lock backend"
        )
        parser.error(f"--backend {dotted!r} {why}: {e}")
    finally:
        sys.path.remove(os.getcwd())


def main(argv: list[str] | None = None) -> int:
    args, rest = parse(sys.argv[1:] if argv is None else argv)
    import pytest

    tmp = tempfile.mkdtemp(prefix="dlock-conformance-")
    ini = Path(tmp) / "pytest.ini"
    ini.write_text(PYTEST_INI)
    # In the environment, not only in this process: pytest-xdist's workers and
    # the processes the tests start read the same settings, and import the
    # backend from the same directories (the current one first, as here).
    os.environ.update(
        {
            "DLOCK_TEST_BACKEND": args.backend,
            "DLOCK_TEST_LOCATION": args.location or "",
            "DLOCK_TEST_OPTIONS": args.options or "",
            "DLOCK_TEST_DATABASE": args.database or "",
            "DLOCK_TEST_TMP": tmp,
            "DJANGO_SETTINGS_MODULE": "django_dlock.testing.settings",
            # Hypothesis's cache in the run's directory, not in the current one.
            "HYPOTHESIS_STORAGE_DIRECTORY": str(Path(tmp) / "hypothesis"),
            "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p),
        }
    )
    suite = str(Path(__file__).resolve().parent)
    print(f"django-dlock conformance suite: {args.backend} as 'under_test' ({suite})")
    return int(
        pytest.main(
            [
                "-c",
                str(ini),
                "--rootdir",
                suite,
                "-p",
                "django_dlock.testing.plugin",
                "-p",
                "no:cacheprovider",
                "--ds",
                "django_dlock.testing.settings",
                *rest,
                suite,
            ]
        )
    )


if __name__ == "__main__":
    sys.exit(main())
