"""No import circles among the executor's modules, counting function-local imports too.

A function-local import can hide a circle (``frontends → lattice_client → proxy → server_main →
frontends`` was held together that way): this test reads every ``import`` statement of the
first-party packages with ``ast`` (wherever it sits, except under ``if TYPE_CHECKING:``) and fails
on any cycle that passes through ``executor``. One fresh interpreter also imports the executor
modules that only the lattice loads, each first, to catch an order-dependent import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("executor", "engine", "pdserve", "ctx_worker", "gen_worker", "kv_transfer", "orchestrator", "pdbench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.AST) -> list[str]:
    """Every imported module name, skipping ``if TYPE_CHECKING:`` blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {t for t in runtime_imports(ast.parse(path.read_text())) if t in modules}
        graph[name] = targets - {name}
    return graph


def cycles_through(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """One cycle per strongly connected component (Tarjan) that contains a ``prefix`` module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [scc for scc in sccs if any(m == prefix or m.startswith(prefix + ".") for m in scc)]


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"executor.a": {"executor.b"}, "executor.b": {"executor.c"}, "executor.c": {"executor.a"},
             "engine.x": {"executor.a"}}
    assert cycles_through(graph, "executor") == [["executor.a", "executor.b", "executor.c"]]


def test_no_import_cycle_through_the_executor():
    assert cycles_through(import_graph(), "executor") == []


def test_lattice_modules_import_on_their_own():
    modules = ["executor.frontends", "executor.lattice_client", "executor.proxy", "executor.server_main",
               "executor.frontend_main", "executor.worker_main", "executor.engine_loop", "executor.lane_transport"]
    code = "; ".join(f"import importlib, sys; importlib.import_module({m!r}); "
                     f"[sys.modules.pop(k) for k in list(sys.modules) if k.split('.')[0] in {PACKAGES!r}]"
                     for m in modules)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


# Entry modules of the processes that never run the model (frontend 0 before its ranks are up, the
# attached frontends, the orchestrator) and the modules a frontend imports when it builds its state.
FRONTEND_SIDE = ["executor.frontend_main", "executor.server_main", "ctx_worker.__main__", "gen_worker.__main__",
                 "executor.frontends", "executor.http_server", "executor.lifecycle", "orchestrator.__main__"]
# torch and the engine proper belong to the ranks; transformers is the frontend's (the tokenizer),
# loaded when the tokenizer loads, not when the module is imported.
RANK_SIDE = ("torch", "transformers", "engine.llm_engine", "engine.model_runner")


def test_frontend_side_modules_import_without_torch_or_the_engine():
    code = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
            f"print(','.join(m for m in {RANK_SIDE!r} if m in sys.modules))")
    for module in FRONTEND_SIDE:  # each in a fresh interpreter: a module imported by an earlier one would hide it
        r = subprocess.run([sys.executable, "-c", code, module], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip() == "", f"importing {module} loads {r.stdout.strip()}"
