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
    """Every hvdlike module ``path`` imports, anywhere in it.

    Absolute dotted names; ``from m import a`` gives ``"m:a"`` (``a`` may be a
    submodule of ``m`` or a name defined in it).
    """
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
            # "from . import x" / "from hvdlike.core import x": x may be a module
            # (then the package itself is only the parent of what is imported).
            found.update(f"{module}:{a.name}" for a in node.names)
    return found


def _core_modules() -> Dict[str, str]:
    """``{dotted name under hvdlike.core: file}`` for every module of core/, subpackages too."""
    modules = {}
    for folder, _, files in os.walk(CORE):
        rel = os.path.relpath(folder, CORE)
        package = [] if rel == "." else rel.split(os.sep)
        for name in files:
            if not name.endswith(".py"):
                continue
            parts = package + ([] if name == "__init__.py" else [name[:-3]])
            if parts:
                modules[".".join(parts)] = os.path.join(folder, name)
    return modules


def _core_graph() -> Dict[str, Set[str]]:
    modules = _core_modules()
    graph = {}
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        package = "hvdlike.core." + (module if is_package else module.rpartition(".")[0])
        package = package.rstrip(".")
        edges = set()
        for target in _imports(path, package):
            target, _, attr = target.partition(":")
            if target == "hvdlike.core":
                base = ""
            elif target.startswith("hvdlike.core."):
                base = target[len("hvdlike.core."):]
            else:
                continue
            candidate = f"{base}.{attr}" if base else attr
            name = candidate if attr and candidate in modules else base
            while name and name not in modules:  # "import hvdlike.core.x.y": x.y, else x
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
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
    assert {"hvdlike.core:api", "hvdlike.core.runtime:Runtime"} <= _imports(str(path),
                                                                            "hvdlike.core")


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
                target = target.replace(":", ".")
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
