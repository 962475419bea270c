"""Sphinx configuration: the Markdown pages through MyST, the API from docstrings.

`make docs` builds it with warnings as errors (`sphinx-build -W`).
"""

from __future__ import annotations

import doctest
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "testproject")]

# autodoc imports django_dlock's models and admin: they need a configured Django.
# The doctests lock on the test project's zero-config default, the database
# backend, in a SQLite file of their own.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
_scratch = tempfile.mkdtemp(prefix="dlock-docs-")
os.environ.setdefault("DLOCK_DEMO_DB", os.path.join(_scratch, "docs.sqlite3"))
os.environ.setdefault("DLOCK_CELERY_DATA", os.path.join(_scratch, "celery"))
import django  # noqa: E402

django.setup()

project = "django-dlock"
author = "django-dlock developers"
copyright = "2026, django-dlock developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# Links such as [Listing](benchmarks.md#listing-100000-and-1000000-locks) resolve to headings.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

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
