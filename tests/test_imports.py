"""The package's layering: no import cycles, between modules or between sub-packages.

Read statically (``ast``), so the test sees every import, also those inside functions (a
cycle hidden in a function is still a cycle in the design) but not those under
``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "fxpipe"


def _module_name(path: Path) -> str:
    parts = ["fxpipe", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The fxpipe modules ``path`` imports (a package import counts as its ``__init__``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(base: str, names: list[str]) -> None:
        for alias in names:  # `from pkg import module` imports the module
            if f"{base}.{alias}" in modules:
                found.add(f"{base}.{alias}")
            elif base in modules:
                found.add(base)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base.startswith("fxpipe"):
                resolve(base, [a.name for a in node.names])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.discard(name)
    return found


def _graph() -> nx.DiGraph:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    g = nx.DiGraph()
    for path in paths:
        g.add_node(_module_name(path))
        for target in _imports(path, modules):
            g.add_edge(_module_name(path), target)
    return g


def test_no_module_imports_itself_through_others() -> None:
    g = _graph()
    # A package __init__ re-exporting its modules is not a design cycle: drop the edges
    # from an __init__ into its own package.
    own = [(u, v) for u, v in g.edges if v.startswith(u + ".")]
    g.remove_edges_from(own)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_sub_packages_are_layered() -> None:
    """runtime/ knows nothing of skip/ (torchgpipe's @skippable API is built on the runtime)."""
    upward = [(u, v) for u, v in _graph().edges if u.startswith("fxpipe.runtime") and v.startswith("fxpipe.skip")]
    assert not upward, upward


# The build's order, low to high: a module imports only its own layer and those below it.
# Shared values (errors, tree, progress) sit below everything; the front doors (api,
# distributed, the torchgpipe-compatible gpipe / balance / batchnorm / skip, and tune, which
# plans through the build) above the build;
# the command line on top.
LAYERS = [
    ("shared", ("fxpipe.errors", "fxpipe.tree", "fxpipe.progress")),
    ("runtime", ("fxpipe.runtime",)),
    ("capture", ("fxpipe.capture",)),
    ("checks", ("fxpipe.checks",)),
    ("plan", ("fxpipe.plan",)),
    ("emit", ("fxpipe.emit", "fxpipe.portals")),
    ("build", ("fxpipe.build",)),
    ("front doors", ("fxpipe.api", "fxpipe._step", "fxpipe._mode_variants", "fxpipe.distributed", "fxpipe.gpipe", "fxpipe.balance",
                     "fxpipe.batchnorm", "fxpipe.skip", "fxpipe.tuning")),
    ("cli", ("fxpipe.cli", "fxpipe.__main__")),
]


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(LAYERS)  # the package itself: fxpipe/__init__ names the front doors


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in _graph().nodes if _layer(m) == len(LAYERS) and m != "fxpipe")
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_imports_point_down_the_build_order() -> None:
    """runtime < capture < checks < plan < emit < build < api / distributed < cli."""
    upward = sorted(f"{u} ({LAYERS[_layer(u)][0]}) imports {v} ({LAYERS[_layer(v)][0]})"
                    for u, v in _graph().edges if _layer(v) > _layer(u) and v != "fxpipe")
    assert not upward, "imports against the build order:\n" + "\n".join(upward)
