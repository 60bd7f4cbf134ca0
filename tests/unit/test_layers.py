"""The layout rules, read from the source with ``ast`` (nothing is imported):

* no import cycle between the project's modules;
* the libraries (``templating``, ``auth``, ``ratelimit``, ``backend``, ``kernels_cupy``) never import ``gateway``;
* ``gateway/errors.py`` imports no project module (every layer may raise its errors);
* no ``.py`` file under ``gateway/`` is over 400 lines.

Every import counts: module level, inside functions, under ``if TYPE_CHECKING:``; relative imports are resolved
against the importing module's package. An import names the most specific project module it reaches
(``from gateway.filters import base`` -> ``gateway.filters.base``; ``from gateway.filters import Hook`` ->
``gateway.filters``); the implicit import of parent packages is not an edge.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "auth", "ratelimit", "templating", "backend", "kernels_cupy")
LIBRARIES = tuple(p for p in PACKAGES if p != "gateway")
MAX_GATEWAY_LINES = 400


def _module_name(path: Path) -> str:
    """``gateway/filters/__init__.py`` -> ``gateway.filters``; ``gateway/errors.py`` -> ``gateway.errors``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    """Every module of ``PACKAGES``: dotted name -> file (a package's ``__init__.py`` over a module file of
    the same name, as Python's import system chooses)."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            name = _module_name(p)
            if name not in out or p.name == "__init__.py":
                out[name] = p
    return out


def _imported_names(module: str, is_package: bool, tree: ast.Module) -> Iterator[tuple[str, int]]:
    """Absolute dotted names ``module`` imports anywhere in ``tree``, with their line: ``import a.b`` gives
    ``a.b``; ``from .x import y`` gives ``<package>.x.y`` (``y`` may be a module or a name in
    ``<package>.x``). ``is_package``: ``module`` is a package's ``__init__``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                yield (f"{base}.{alias.name}" if alias.name != "*" else base), node.lineno


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is a project module, or None (an outside package)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in modules:
            return candidate
    return None


def import_graph() -> dict[str, dict[str, int]]:
    """Project module -> {imported project module: line of the first such import}."""
    sources = _sources()
    modules = set(sources)
    graph: dict[str, dict[str, int]] = {}
    for module, path in sources.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: dict[str, int] = {}
        for name, line in _imported_names(module, path.name == "__init__.py", tree):
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def _cycle_in(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth-first inside the component)."""
    start, inside = component[0], set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in inside and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_walker_sees_every_kind_of_import():
    """Absolute, relative (from a module and from a package), function-level and TYPE_CHECKING imports are
    found and resolved (else the rules below would pass vacuously)."""
    src = """
import a.b
from typing import TYPE_CHECKING
from . import sibling
from ..up import thing
if TYPE_CHECKING:
    from c import D
def f():
    from e.f import g
"""
    tree = ast.parse(src)
    names = {n for n, _ in _imported_names("p.q.mod", False, tree)}
    assert names >= {"a.b", "p.q.sibling", "p.up.thing", "c.D", "e.f.g"}, names
    names = {n for n, _ in _imported_names("p.q", True, tree)}  # p/q/__init__.py: "." is p.q itself
    assert names >= {"p.q.sibling", "p.up.thing"}, names
    modules = {"p", "p.up", "p.up.thing", "e.f"}
    assert _resolve("p.up.thing", modules) == "p.up.thing"  # a submodule
    assert _resolve("e.f.g", modules) == "e.f"  # a name inside a module
    assert _resolve("os.path", modules) is None  # outside the project
    graph = import_graph()
    assert "templating.tokenizer" in graph["templating.chat_template"]
    assert "gateway.filters.base" in graph["gateway.filters"]  # from .base import ...
    assert "gateway.errors" in graph  # a module without project imports is still a node


def test_no_import_cycles():
    graph = import_graph()
    report = [
        f"{_describe(_cycle_in(c, graph), graph)}  [{len(c)} modules in this tangle: {', '.join(c)}]"
        for c in _components(graph)
    ]
    assert not report, "import cycles (a (line n) -> b: a imports b at line n):\n" + "\n".join(report)


def test_libraries_never_import_the_gateway():
    graph = import_graph()
    bad = [
        f"{module} imports {target} (line {line})"
        for module, edges in sorted(graph.items())
        if module.split(".")[0] in LIBRARIES
        for target, line in sorted(edges.items())
        if target.split(".")[0] == "gateway"
    ]
    assert not bad, "a library imports the gateway:\n" + "\n".join(bad)


def test_gateway_errors_imports_no_project_module():
    edges = import_graph()["gateway.errors"]
    assert not edges, f"gateway/errors.py imports project modules: {edges}"


def test_no_gateway_file_over_400_lines():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for p in sorted((ROOT / "gateway").rglob("*.py"))
    }
    over = {path: n for path, n in sizes.items() if n > MAX_GATEWAY_LINES}
    assert not over, f"gateway files over {MAX_GATEWAY_LINES} lines: " + ", ".join(
        f"{path} ({n})" for path, n in sorted(over.items(), key=lambda kv: -kv[1])
    )
