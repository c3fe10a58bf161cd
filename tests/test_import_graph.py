"""The package's import structure: no circles among module-level imports, and the attention layer (registry,
backend declarations, the LLM backend contract) loads without the runtimes above it.

Why: issue 12 asked that adding backends leave the attention package without import circles and that the backend
contract not need the runtime's batch class at import time; issue 13 that the model runner and its graph runner
stop importing each other. Imports inside functions (lazy, for optional kernels) and under TYPE_CHECKING are not
edges: they never run at import time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _edges(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """sglx modules `name` imports at module level (the module itself where `from m import x` names a submodule)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, ast.Import):
                found.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                base = ".".join(package[:len(package) - n.level + 1] + [n.module or ""]).strip(".") if n.level \
                    else (n.module or "")
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in n.names)
    return {m for m in found if m in mods and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_module_level_import_circles() -> None:
    mods = _modules()
    graph = {name: _edges(name, path, mods) for name, path in mods.items()}
    assert len(graph) > 100 and graph["sglx.llm.model_runner"], "the scan found the package"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_attention_layer_imports_without_the_runtimes() -> None:
    code = ("import sys\n"
            "import sglx.attention.registry, sglx.attention.llm_backends, sglx.attention.diffusion_backends\n"
            "import sglx.attention.llm.base, sglx.attention.diffusion.base\n"
            "print(sorted(m for m in sys.modules if m.startswith(('sglx.llm', 'sglx.diffusion'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
