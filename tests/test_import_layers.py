"""The package's layers import only downward and its modules form no import cycle.

The graph is read from the source with `ast`: every import statement counts, lazy ones inside functions
included; only `if TYPE_CHECKING:` blocks are left out (they never run). `from A import b` depends on
module A.b when that is a module, else on A itself (a package's `__init__`).

Layers, lowest first (CONTRIBUTING.md, "Layers"):
  0 the native engine binding (pyep._native), the version (pyep._version), reading untrusted input
    (pyep._input)
  1 softnic, wqe, nic, config
  2 transport
  3 ep: shared modules (pyep/ep/*.py) < elastic < ll, normal (ll and normal never import each other)
    < elastic.drill_rank, elastic.drill_normal (the drills' rank loops drive an EpBuffer / a NormalBuffer,
      so they sit above ll and normal)
  4 compat, bench, launch, doctor
  5 cli
and the top-level `pyep` package and `pyep.__main__` above all of them (nothing imports them).
"""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "pyep"

# (top-level part, ep subpackage or None) -> layer; ep sublayers are fractional so that ep/ll may use
# ep/elastic and the shared ep modules but not the other way round. An ep sublayer key is a dotted path
# under pyep.ep; the longest one that prefixes a module decides its layer.
LAYERS: Dict[str, float] = {
    "_native": 0, "_version": 0, "_input": 0, "softnic": 1, "wqe": 1, "nic": 1, "config": 1, "transport": 2, "ep": 3.0,
    "compat": 4, "bench": 4, "launch": 4, "doctor": 4, "cli": 5,
}
EP_SUBLAYERS: Dict[str, float] = {"elastic": 3.1, "ll": 3.2, "normal": 3.2, "elastic.drill_rank": 3.3,
                                  "elastic.drill_normal": 3.3}
TOP = 99.0


def module_files(root: pathlib.Path = ROOT) -> Dict[str, pathlib.Path]:
    out: Dict[str, pathlib.Path] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


class _Imports(ast.NodeVisitor):
    def __init__(self) -> None:
        self.nodes: List[ast.AST] = []

    def visit_If(self, node: ast.If) -> None:
        t = node.test
        if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
                (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.nodes.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.nodes.append(node)


def _owner(name: str, mods: Dict[str, pathlib.Path]) -> Optional[str]:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: pathlib.Path = ROOT) -> Dict[str, Set[Tuple[str, int]]]:
    """module -> {(imported module, line)} for the modules of the package at `root`."""
    mods = module_files(root)
    graph: Dict[str, Set[Tuple[str, int]]] = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        visitor = _Imports()
        visitor.visit(ast.parse(path.read_text(), str(path)))
        deps: Set[Tuple[str, int]] = set()
        for node in visitor.nodes:
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                assert isinstance(node, ast.ImportFrom)
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for alias in node.names:
                    sub = f"{src}.{alias.name}"
                    targets.append(sub if sub in mods else src)
            for t in targets:
                if t.split(".")[0] != root.name:
                    continue
                owner = _owner(t, mods)
                if owner is not None and owner != mod:
                    deps.add((owner, node.lineno))
        graph[mod] = deps
    return graph


def layer_of(mod: str) -> float:
    parts = mod.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return TOP
    if parts[1] == "ep":
        for n in range(len(parts) - 2, 0, -1):
            key = ".".join(parts[2:2 + n])
            if key in EP_SUBLAYERS:
                return EP_SUBLAYERS[key]
    if parts[1] not in LAYERS:
        raise AssertionError(f"{mod}: module outside every layer; add its package to LAYERS and to "
                             f"CONTRIBUTING.md")
    return LAYERS[parts[1]]


def find_cycles(graph: Dict[str, Set[Tuple[str, int]]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    edges = {m: sorted({d for d, _ in ds}) for m, ds in graph.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            succ = edges.get(v, [])
            if i < len(succ):
                work.append((v, i + 1))
                w = succ[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def layer_violations(graph: Dict[str, Set[Tuple[str, int]]]) -> List[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep, line in sorted(deps):
            if layer_of(dep) > layer_of(mod):
                bad.append(f"{mod}:{line} imports {dep} (layer {layer_of(dep)} above {layer_of(mod)})")
            elif {mod.split(".")[2:3][0] if mod.startswith("pyep.ep.") else "",
                  dep.split(".")[2:3][0] if dep.startswith("pyep.ep.") else ""} == {"ll", "normal"}:
                bad.append(f"{mod}:{line} imports {dep} (ll and normal are siblings)")
    return bad


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_layers_import_only_downward() -> None:
    bad = layer_violations(import_graph())
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_look_for(tmp_path: pathlib.Path) -> None:
    """A cycle, an upward import (lazy, inside a function) and an ll -> normal import in a toy package
    are found; a TYPE_CHECKING import is not."""
    pkg = tmp_path / "pyep"
    for d in ("", "transport", "ep", "ep/ll", "ep/normal", "cli"):
        (pkg / d).mkdir(parents=True, exist_ok=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "transport" / "a.py").write_text("def f():\n    from ..ep import b\n")
    (pkg / "ep" / "b.py").write_text("from . import c\n")
    (pkg / "ep" / "c.py").write_text("from .b import x\n")
    (pkg / "ep" / "ll" / "m.py").write_text("from ..normal import n\n")
    (pkg / "ep" / "normal" / "n.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ...cli import anything\n")
    graph = import_graph(pkg)
    assert find_cycles(graph) == [["pyep.ep.b", "pyep.ep.c"]]
    bad = layer_violations(graph)
    assert any(b.startswith("pyep.transport.a:2 imports pyep.ep.b") for b in bad), bad
    assert any("ll and normal are siblings" in b for b in bad), bad
    assert not any("cli" in b for b in bad), bad


@pytest.mark.parametrize("mod", sorted(module_files()))
def test_every_module_has_a_layer(mod: str) -> None:
    layer_of(mod)
