"""The declared layer order holds: every import of autopar code (module-level or inside a
function) goes to the same or a lower layer, and the module import graph has no cycle.

The order, bottom first, is the one ``autopar/__init__.py`` and the README's "How it works"
state; the test checks that they say the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"autopar": "autopar", "cost_models": "autopar.cost_models", "passes": "autopar.passes"}

# bottom first: (layer name, the module prefixes it owns); a module belongs to its longest prefix
LAYERS = (
    ("core", ("autopar.core", "autopar.passes")),
    ("capture", ("autopar.passes.capture",)),
    ("rules", ("autopar.passes.rules",)),
    ("cost models", ("autopar.cost_models",)),
    ("plan", ("autopar.plan",)),
    ("planning", ("autopar.planner", "autopar.solver")),
    ("communication", ("autopar.comm",)),
    ("codegen", ("autopar.passes.codegen",)),
    ("runtime", ("autopar.runtime",)),
    ("API", ("autopar",)),
)


def modules() -> dict[str, Path]:
    """Every autopar module by its import name (cost_models/ and passes/ install under autopar)."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
    return out


def layer_of(module: str) -> int:
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[1]


def imports(path: Path, known) -> list[tuple[str, int]]:
    """``(imported autopar module, line)`` for every import statement in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("autopar"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((sub if sub in known else node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("autopar")]
    return out


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for module, path in known.items():
        for target, line in imports(path, known):
            graph.add_edge(module, target, line=line)
    return graph


def upward_imports(graph: nx.DiGraph) -> list[str]:
    return [f"{a}:{d['line']} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
            for a, b, d in graph.edges(data=True) if layer_of(b) > layer_of(a)]


def test_every_import_goes_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_no_module_imports_itself_back_even_inside_a_function():
    graph = import_graph()
    graph.remove_edges_from(nx.selfloop_edges(graph))
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], [" -> ".join(c + c[:1]) for c in cycles[:5]]


@pytest.mark.parametrize("arrow", [
    ("autopar.planner.intra", "autopar.baselines"),
    ("autopar.passes.codegen.split", "autopar.runtime.program"),
    ("autopar.cost_models.cluster", "autopar.profiler"),
    ("autopar.comm.mesh", "autopar.runtime.program"),
])
def test_the_check_catches_an_upward_arrow(arrow):
    graph = import_graph()
    graph.add_edge(*arrow, line=0)
    assert len(upward_imports(graph)) == 1


def communication_imports_beyond_the_core(graph: nx.DiGraph) -> list[str]:
    """Imports from the communication layer of anything but itself and the core: DESIGN keeps
    it a leaf library, whatever the layer order would allow."""
    return [f"{a} imports {b}" for a, b in graph.edges
            if LAYERS[layer_of(a)][0] == "communication" and LAYERS[layer_of(b)][0] not in ("core", "communication")]


def test_communication_imports_only_the_core():
    graph = import_graph()
    assert communication_imports_beyond_the_core(graph) == []
    graph.add_edge("autopar.comm.collectives", "autopar.passes.rules.registry", line=0)  # the order allows it
    assert len(communication_imports_beyond_the_core(graph)) == 1


def _declared_order(text: str) -> list[str]:
    """The layer names of a numbered list ``N. name — ...`` (or ``N. **name** ...``)."""
    return [m.group(1).strip().lower() for m in re.finditer(r"^\s*\d+\.\s+\**([a-zA-Z ]+?)\**\s+[—:-]", text, re.M)]


def test_readme_and_package_docstring_state_this_order():
    want = [name.lower() for name, _ in LAYERS]
    import autopar

    assert _declared_order(autopar.__doc__) == want
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("How it works"):]
    assert _declared_order(section)[:len(want)] == want
