"""django_dlock raises no DeprecationWarning: not on import, not in ``manage.py check``.

Nothing has been released, so nothing has an old name to keep. Each check runs
in a fresh interpreter, where every module is imported for the first time.
A DeprecationWarning counts as django_dlock's when it is issued at a line of
the package (``warnings.warn`` there, or a dependency's API called from there,
which warns with the caller's line): the filter below turns those into errors.
Others (a dependency's own) are printed and left alone. pyproject.toml's
``filterwarnings`` does the same for the whole test suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import django_dlock

PACKAGE = Path(django_dlock.__file__).resolve().parent
ROOT = PACKAGE.parent

# In the child: DeprecationWarnings issued at a django_dlock line are errors,
# all others are recorded and printed.
PRELUDE = """
import importlib, pkgutil, sys, traceback, warnings
from pathlib import Path

warnings.simplefilter("always", DeprecationWarning)
warnings.filterwarnings("error", category=DeprecationWarning, module=r"django_dlock(\\..*)?$")
seen = []
warnings.showwarning = lambda message, category, filename, lineno, *rest: seen.append(
    f"{category.__name__} at {filename}:{lineno}: {message}"
)

import django

django.setup()
"""

IMPORT_ALL = """
import django_dlock

failures = []
skipped = []


def missing_extra(error):
    # A dependency of an extra that is not installed, not one of ours.
    name = getattr(error, "name", None) or ""
    return isinstance(error, ImportError) and name and not name.startswith("django_dlock")


def on_package_error(name):
    error = sys.exc_info()[1]
    if missing_extra(error):
        skipped.append(f"{name}: {error}")
    else:
        failures.append(f"{name}: {traceback.format_exc()}")


names = {
    info.name
    for info in pkgutil.walk_packages(
        django_dlock.__path__, "django_dlock.", onerror=on_package_error
    )
}
# walk_packages does not enter a directory without __init__.py (a namespace
# package, as django_dlock.backends is): every .py file is a module to import.
root = Path(django_dlock.__file__).parent
for path in root.rglob("*.py"):
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    names.add(".".join(("django_dlock", *parts)))
names = sorted(names)
for name in names:
    try:
        importlib.import_module(name)
    except Exception as error:
        if missing_extra(error):
            skipped.append(f"{name}: {error}")
        else:
            failures.append(f"{name}: {traceback.format_exc()}")
print(f"imported {len(names) - len(skipped)} modules")
for line in skipped:
    print("skipped (an extra is not installed):", line)
for line in seen:
    print("not django_dlock's:", line)
for line in failures:
    print("FAILED", line)
sys.exit(1 if failures else 0)
"""

CHECK = """
from django.core.management import call_command

call_command("check")
for line in seen:
    print("not django_dlock's:", line)
"""


def _run(body: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "testproject")]),
    }
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_importing_every_module_raises_no_deprecation_warning() -> None:
    result = _run(IMPORT_ALL)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imported " in result.stdout


def test_manage_py_check_raises_no_deprecation_warning() -> None:
    result = _run(CHECK)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified" in result.stdout + result.stderr


def test_the_package_has_no_deprecation_shim() -> None:
    """No code of the package issues a DeprecationWarning: there is no old name to keep."""
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "DeprecationWarning" in line
    ]
    assert found == []
