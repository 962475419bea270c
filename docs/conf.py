"""Sphinx configuration: the Markdown pages through MyST, the API from docstrings.

`make docs` builds the html with warnings as errors (`sphinx-build -W`) in a
virtualenv of the `docs` dependency group alone, then runs the pages'
doctests.
"""

from __future__ import annotations

import doctest
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

# autodoc imports django_dlock's models and admin: they need a configured
# Django. The doctests lock on the zero-config default, the database backend,
# in a SQLite file of their own. No project settings: the html build needs
# nothing but the docs group (Django among it).
import django  # noqa: E402
from django.conf import settings  # noqa: E402

if not settings.configured:
    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "django_dlock",
        ],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": os.path.join(tempfile.mkdtemp(prefix="dlock-docs-"), "docs.sqlite3"),
            }
        },
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        USE_TZ=True,
        SECRET_KEY="django-dlock-docs-only",
    )
django.setup()


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # its parent package is missing
        return True


# The clients of the optional integrations and backends: autodoc imports the
# modules that use them, and documents them just as well with stand-ins, so
# the docs group need not install them. Only what is missing is mocked: a
# mocked module stays imported, and the doctests (which need Celery) must get
# the real one where it is installed.
OPTIONAL_CLIENTS = [
    "celery",
    "kombu",
    "redis",
    "django_redis",
    "prometheus_client",
    "opentelemetry",
    "health_check",
    "django_tasks",
    "kazoo",
]
autodoc_mock_imports = [m for m in OPTIONAL_CLIENTS if _missing(m)]

project = "django-dlock"
author = "django-dlock developers"
copyright = "2026, django-dlock developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# Links such as [Listing](benchmarks.md#listing-100000-and-1000000-locks) resolve to headings.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# docs/api.rst says which modules are public; autodoc documents the names in
# their __all__ that have a docstring (tests/test_api_reference.py checks
# that this is all of them, and nothing else).
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

doctest_global_setup = """
from django.core.management import call_command
call_command("migrate", verbosity=0, interactive=False)
"""
doctest_default_flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

html_theme = "furo"
html_title = "django-dlock"
# Wide tables scroll in their own box, with columns kept readable (tables.css).
html_static_path = ["_static"]
html_css_files = ["tables.css"]


# Handles are made by the backends, never by callers: HeldLock's page shows
# its attributes, not its constructor's parameters, which autodoc_typehints =
# "description" would list from __init__ (the directive already hides the
# signature). Run after autodoc recorded them (its handler has priority 500);
# where they are kept differs between Sphinx versions.
NO_CONSTRUCTOR_TYPES = {"django_dlock.HeldLock"}


def _drop_constructor_types(app: Any, what: str, name: str, *args: Any) -> None:
    if what != "class" or name not in NO_CONSTRUCTOR_TYPES:
        return
    document = getattr(app.env, "current_document", None)
    kept = getattr(document, "autodoc_annotations", None)
    if kept is None:
        kept = app.env.temp_data.get("annotations", {})
    kept.pop(name, None)


def setup(app: Any) -> None:
    app.connect("autodoc-process-signature", _drop_constructor_types, priority=900)
