"""No import circle among edgespec's own modules: each module's imports (at its top, inside
functions, anywhere but under `if TYPE_CHECKING:`) read from its source with `ast`, every
package's `__init__` included, and the graph searched for a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the installed package's folders (pyproject's package-dir: models/ and tui/ are installed inside edgespec)
PACKAGES = {"edgespec": ROOT / "edgespec", "edgespec.models": ROOT / "models", "edgespec.tui": ROOT / "tui"}


def modules() -> dict[str, Path]:
    """Every module of edgespec by dotted name ('edgespec.drafters' for its __init__)."""
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            if any(p.startswith(".") or p == "__pycache__" for p in rel):
                continue
            name = ".".join((pkg, *rel))
            out[name] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes anywhere in `tree` but under `if TYPE_CHECKING:` (never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def graph() -> dict[str, set[str]]:
    """Module -> the edgespec modules it imports."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rsplit(".", 1)[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # `from pkg import sub` imports the submodule where there is one
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a name inside a module: its module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports():
    # the reader itself: a relative import, a lazy one inside a function, a package's submodule
    g = graph()
    assert "edgespec.costmodel" in g["edgespec.costmeasure"]
    assert "edgespec.costmeasure" in g["edgespec.costcache"]
    assert "edgespec.drafters.chain" in g["edgespec.methods"]  # imported inside a builder function
    assert "edgespec.kernels" in g["edgespec"]  # `from . import kernels`


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import circles among edgespec's modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cost_model_is_pure():
    # the model reads no model and no file: measuring is costmeasure's, the cache costcache's
    g = graph()
    assert g["edgespec.costmodel"] == set()
    assert "edgespec.costcache" not in g["edgespec.costmeasure"]
