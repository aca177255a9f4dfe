"""The memrl package has no import cycle among its own modules.

The graph is read from the source with `ast` (nothing is imported): an edge A -> B for every import of
memrl module B that runs when A is imported, i.e. at module or class level, `if TYPE_CHECKING:` and
`try:` blocks included (a cycle that only type checkers follow is still a cycle of the design), imports
inside function bodies excluded (those are the deliberate way to defer a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import memrl

PACKAGE_ROOT = Path(memrl.__file__).parent

def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at `root` (its folder name is the package name)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _import_time_nodes(tree: ast.AST):
    """The nodes that run when the module is imported: everything outside function bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                stack.append(child)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at import time."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _import_time_nodes(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*base_parts, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                # `from pkg import mod` imports module pkg.mod; `from mod import name` imports mod
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_memrl_has_no_import_cycle():
    graph = import_graph(PACKAGE_ROOT)
    assert "memrl.engines.hf_batch" in graph["memrl.engines.hf"], "the walker missed a module-level import"
    assert "memrl.engines.hf" not in graph["memrl.engines.hf_batch"]  # the batch gets a ModelRunner instead
    found = cycles(graph)
    assert not found, "import cycles among memrl modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_walker_finds_a_cycle_through_type_checking_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("from pkg.sub.b import B\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nB = 1\n")
    (package / "c.py").write_text("def late():\n    from pkg.sub import a\n")  # deferred: no edge
    (package / "d.py").write_text("from pkg import c\nfrom . import sub\n")
    graph = import_graph(package)
    assert graph["pkg.sub.b"] == {"pkg.sub.a"} and graph["pkg.c"] == set()
    assert graph["pkg.d"] == {"pkg.c", "pkg.sub"}
    assert cycles(graph) == [("pkg.sub.a", "pkg.sub.b")]
