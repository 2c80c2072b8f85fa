"""Import structure: no cycles inside core/, front ends independent of each other.

Read from the source with ``ast``, so imports inside functions count as much
as those at the top of a module: a function-local import only hides a cycle.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORE = os.path.join(ROOT, "core")
INTEGRATIONS = os.path.join(ROOT, "integrations")


def _imports(path: str, package: str) -> Set[str]:
    """Every hvdlike module ``path`` imports, anywhere in it (absolute dotted names)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hvdlike"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("hvdlike"):
                continue
            found.add(module)
            # "from . import x" / "from hvdlike.core import x": x may be a module.
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def _core_graph() -> Dict[str, Set[str]]:
    modules = {name[:-3] for name in os.listdir(CORE)
               if name.endswith(".py") and name != "__init__.py"}
    graph = {}
    for module in modules:
        edges = set()
        for target in _imports(os.path.join(CORE, module + ".py"), "hvdlike.core"):
            parts = target.split(".")
            if parts[:2] == ["hvdlike", "core"] and len(parts) > 2 and parts[2] in modules:
                if parts[2] != module:
                    edges.add(parts[2])
        graph[module] = edges
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_function_local_imports_are_seen(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from . import api\n    from .runtime import Runtime\n")
    assert {"hvdlike.core.api", "hvdlike.core.runtime"} <= _imports(str(path), "hvdlike.core")


def test_core_has_no_import_cycles():
    graph = _core_graph()
    assert "registry" in graph["runtime"], graph["runtime"]  # the graph was read
    assert len(graph) > 20, sorted(graph)
    cycles = _cycles(graph)
    assert not cycles, "import cycles inside core/ (function-local imports included): " + \
        "; ".join(" <-> ".join(c) for c in cycles)


NON_TORCH = ("numpy", "jax", "keras")


def test_non_torch_front_ends_never_import_the_torch_front_end_in_source():
    offenders = []
    for frontend in NON_TORCH + ("frontend",):
        folder = os.path.join(INTEGRATIONS, frontend)
        package = f"hvdlike.{frontend}"
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py"):
                continue
            for target in _imports(os.path.join(folder, name), package):
                if target == "hvdlike.torch" or target.startswith("hvdlike.torch."):
                    offenders.append(f"integrations/{frontend}/{name} imports {target}")
    assert not offenders, offenders


def test_importing_the_numpy_front_end_leaves_the_torch_front_end_unloaded():
    code = ("import sys, hvdlike.numpy\n"
            "loaded = sorted(m for m in sys.modules if m == 'hvdlike.torch' "
            "or m.startswith('hvdlike.torch.'))\n"
            "print(loaded)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
