"""The package's module graph: no import circle, no private name used across modules.

Imports are read from the source (``ast``), at module level and inside
functions alike: a function-level import is an edge too, only a later one.
The graph is read twice: as it runs (imports under ``if TYPE_CHECKING:``
left out), and as the type checker reads it (those imports counted too). It
has no circle either way: a module that needs another's type for its
annotations only is typed against a protocol in a leaf module
(``backends/protocol.py``) rather than importing it.

The rule for an edge: ``import django_dlock.x.y`` and ``from django_dlock.x
import y`` are edges to the longest module the dotted name names
(``django_dlock.x.y`` if it is a module, else ``django_dlock.x``); ``from . import
conf`` is an edge to ``conf``, not to the package's ``__init__``. A package's
``__init__`` re-exporting its submodules counts as edges from it, as any module's
imports do, so a submodule that imported a name from its package root would
close a circle through it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import django_dlock

ROOT = Path(django_dlock.__file__).parent
PACKAGE = "django_dlock"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "migrations" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    module: str, path: Path, modules: dict[str, Path], type_checking: bool = False
) -> set[str]:
    """The package's modules that ``module`` imports, at any level.

    With ``type_checking``, also those it imports under ``if TYPE_CHECKING:``.
    """
    is_package = path.name == "__init__.py"
    edges: set[str] = set()

    def resolve(target: str) -> None:
        # The longest known module that the dotted name starts with.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != module:
            edges.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.startswith(PACKAGE):
                for alias in node.names:
                    # "from . import conf" imports the module conf.
                    candidate = f"{source}.{alias.name}"
                    resolve(candidate if candidate in modules else source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return edges


def _graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, type_checking) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules along it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state:
                found = walk(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return None


def test_the_checker_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "django_dlock.handler" in graph["django_dlock.lock"]
    assert "django_dlock.held" in graph["django_dlock.backends.base"]


def test_no_import_circle_among_the_package_modules() -> None:
    graph = _graph()
    # The package's __init__ imports the public API from everywhere; a module
    # that imports a name from the package root would close a circle through it.
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_import_circle_counting_the_type_checking_imports() -> None:
    """Annotations too: no module is typed against one that imports it, however far back."""
    graph = _graph(type_checking=True)
    assert _cycle(graph) is None, "import circle: " + " -> ".join(_cycle(graph) or [])


def test_the_type_checking_imports_are_read() -> None:
    graph = _graph(type_checking=True)
    # held.py imports the protocols only for its annotations.
    assert "django_dlock.backends.protocol" in graph["django_dlock.held"]
    assert "django_dlock.backends.protocol" not in _graph()["django_dlock.held"]


def test_the_protocols_are_a_leaf() -> None:
    """``backends/protocol.py`` imports value types only, so anything may be typed against it."""
    graph = _graph(type_checking=True)
    assert graph["django_dlock.backends.protocol"] <= {
        "django_dlock.backends.offload",
        "django_dlock.backends.types",
    }


def test_signals_is_a_leaf() -> None:
    assert _graph()["django_dlock.signals"] == set()


#: Lines a module may have (docs/STYLE: modules of at most 600 lines).
MAX_LINES = 600


#: The first line of the modules scripts/gen_etcd_stubs.py writes: protoc's
#: output, not code of ours to size (the gRPC service stubs alone are 2,000 lines).
GENERATED = "# Written by scripts/gen_etcd_stubs.py"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_module_is_over_600_lines(module: str) -> None:
    text = _modules()[module].read_text()
    if text.startswith(GENERATED):
        assert module.startswith("django_dlock.backends.etcd.etcdrpc."), module
        return
    lines = len(text.splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines, over {MAX_LINES}"


def _private_names_defined(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)  # a dataclass field set by keyword
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_uses(tree: ast.AST) -> set[str]:
    """Private names this module reaches for on other objects or imports."""
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            used |= {a.name for a in node.names if a.name.startswith("_")}
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            used.add(node.attr)
    return used


def test_no_private_name_is_used_across_modules() -> None:
    trees = {name: ast.parse(path.read_text()) for name, path in _modules().items()}
    defined = {name: _private_names_defined(tree) for name, tree in trees.items()}
    crossing = {}
    for name, tree in trees.items():
        # Another module's private name: used here, not defined here. (Names of
        # third-party libraries, such as Django's ``_meta``, are not ours.)
        ours = set().union(*(d for other, d in defined.items() if other != name))
        foreign = (_private_uses(tree) - defined[name]) & ours
        if foreign:
            crossing[name] = sorted(foreign)
    assert not crossing, crossing
