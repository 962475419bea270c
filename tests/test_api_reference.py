"""The API reference (docs/api.rst) documents the public API: all of it, and nothing else.

What is public: the names in ``__all__`` of the modules in ``PUBLIC_MODULES``
(docs/api.rst says the same at its top). A name importable from two of them
(``django_dlock.LockInfo`` is ``django_dlock.backends.base.LockInfo``) is
documented once, under either. A class's members are documented as its
docstrings and api.rst choose, but never one whose name starts with ``_``.

The documented names are Sphinx's own: api.rst alone is built with the
``dummy`` builder (a few seconds) in a subprocess, whose Python domain lists
what it documents. The optional clients are mocked there, as in a docs-only
virtualenv (docs/conf.py), so a module that autodoc can no longer import
shows up here as names gone missing.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

PUBLIC_MODULES = [
    "django_dlock",
    "django_dlock.exceptions",
    "django_dlock.signals",
    "django_dlock.views",
    "django_dlock.fencing",
    "django_dlock.saves",
    "django_dlock.admin",
    "django_dlock.tickets",
    "django_dlock.transactions",
    "django_dlock.holders",
    "django_dlock.celery",
    "django_dlock.celery.parking",
    "django_dlock.task_framework",
    "django_dlock.contrib.prometheus",
    "django_dlock.contrib.opentelemetry",
    "django_dlock.contrib.health_check",
    # The classes named as BACKEND in DLOCK_BACKENDS.
    "django_dlock.backends.database",
    "django_dlock.backends.redis",
    "django_dlock.backends.etcd",
    "django_dlock.backends.zookeeper",
    "django_dlock.backends.locmem",
    # The contract of a backend of one's own (docs/development.md).
    "django_dlock.backends.base",
    "django_dlock.backends.semaphore_backend",
    "django_dlock.backends.parking_backend",
    "django_dlock.backends.ops",
    "django_dlock.testing",
]

# Run in a fresh interpreter: autodoc's mocks stay in sys.modules, and
# docs/conf.py configures Django with settings of its own.
BUILD = """
import json, sys, tempfile, shutil
from pathlib import Path
from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx

docs = Path(sys.argv[1])
sys.path.insert(0, str(docs))
import conf

out = Path(tempfile.mkdtemp(prefix="dlock-apiref-"))
src = out / "src"
src.mkdir()
shutil.copy(docs / "api.rst", src / "api.rst")
app = Sphinx(
    str(src), str(docs), str(out / "out"), str(out / "doctrees"), "dummy",
    confoverrides={"root_doc": "api", "autodoc_mock_imports": conf.OPTIONAL_CLIENTS},
    status=None, warning=sys.stderr, freshenv=True,
)
app.build()
objects = {
    name: entry.objtype
    for name, entry in app.env.get_domain("py").objects.items()
    if not entry.aliased
}
described = {}
for desc in app.env.get_doctree("api").findall(addnodes.desc):
    content = desc.children[-1].deepcopy()
    for inner in list(content.findall(addnodes.desc)):
        inner.parent.remove(inner)
    text = content.astext().strip()
    for sig in desc.findall(addnodes.desc_signature):
        if sig.parent is desc:
            for node_id in sig["ids"]:
                described[node_id] = bool(text)
shutil.rmtree(out)
print(json.dumps({"objects": objects, "described": described}))
"""


@pytest.fixture(scope="module")
def documented() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", BUILD, str(ROOT / "docs")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    result["warnings"] = done.stderr
    return result


def _public() -> dict[str, Any]:
    """Every public dotted name, and its object."""
    names = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        assert hasattr(module, "__all__"), f"{module_name} has no __all__"
        for name in module.__all__:
            names[f"{module_name}.{name}"] = getattr(module, name)
    return names


def _split(fullname: str) -> tuple[str | None, str]:
    """(the longest public module ``fullname`` is in, the rest), or (None, fullname)."""
    for module in sorted(PUBLIC_MODULES, key=len, reverse=True):
        if fullname.startswith(module + "."):
            return module, fullname[len(module) + 1 :]
    return None, fullname


def test_every_public_name_is_documented(documented: dict[str, Any]) -> None:
    objects = documented["objects"]
    public = _public()
    missing = []
    for fullname, value in public.items():
        name = fullname.rpartition(".")[2]
        # Documented under this name, or the same object under another public module.
        same = [
            other for other, v in public.items() if v is value and other.rpartition(".")[2] == name
        ]
        if not any(other in objects for other in same):
            missing.append(fullname)
    assert not missing, (
        f"public but not in docs/api.rst: {missing}\n(autodoc said: {documented['warnings']})"
    )


def test_only_public_names_are_documented(documented: dict[str, Any]) -> None:
    public = _public()
    not_public = []
    for fullname, objtype in documented["objects"].items():
        module, rest = _split(fullname)
        if objtype == "module":
            if fullname not in PUBLIC_MODULES:
                not_public.append(fullname)
        elif module is None:
            not_public.append(fullname)
        elif "." not in rest:
            if fullname not in public:
                not_public.append(fullname)
        else:
            owner = f"{module}.{rest.partition('.')[0]}"
            if owner not in public or any(part.startswith("_") for part in rest.split(".")):
                not_public.append(fullname)
    assert not not_public, f"documented in docs/api.rst but not public: {sorted(not_public)}"


def test_every_documented_name_says_what_it_is(documented: dict[str, Any]) -> None:
    bare = [
        name
        for name, objtype in documented["objects"].items()
        if objtype != "module" and not documented["described"].get(name, False)
    ]
    assert not bare, f"documented without a description: {sorted(bare)}"
