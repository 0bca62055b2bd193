"""The package's import graph (muser/**.py read as source: module-level, function-local and
TYPE_CHECKING imports alike): no module imports itself through others, no room (a folder of
muser/, or a module at its top) reaches back into a room that imports it, and a function-local
import stands only where an optional dependency or a lighter process requires it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "muser"

# NOTE: what a function may import locally, and why; anything else is imported at the top
OPTIONAL = {  # third-party packages not every install has, or that a process must not load
    "triton": "the [gpu] extra; the CPU install has none",
    "llguidance": "loaded only by requests with a grammar",
    "llama_cpp": "the [reference] extra (muser bench's baseline)",
    "uvicorn": "the [server] extra",
    "transformers": "the [reference] extra",
}
LAZY_MODULES = {  # muser modules a function imports locally
    "muser.ops.triton": "needs triton",
    "muser.server.engine_child": "the engine process's code (torch), imported in that process "
                                 "only: the HTTP process that spawns it never loads torch",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path) -> list[tuple[str, bool, int]]:
    """(imported name, inside a function, line) for every import in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out += [(t, id(node) in local, node.lineno) for t in targets]
    return out


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    modules, graph, local = _modules(), defaultdict(set), []
    for name, path in modules.items():
        for target, inside, line in _imports(name, path):
            if inside:
                local.append((name, target, line))
            if target.split(".")[0] != "muser":
                continue
            dest = _resolve(target, modules)
            if dest is not None and dest != name:
                graph[name].add(dest)
    return graph, local


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def _room(module: str) -> str:
    """muser.ops.triton.gemv -> ops; muser.engine.step -> engine; muser.core -> core."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "muser"


def test_no_module_imports_itself_through_others():
    graph, _ = _graph()
    graph.pop("muser", None)  # NOTE: the package's facade loads LLM lazily (muser/__init__.py)
    assert _cycles(graph) == []


def test_rooms_import_one_way():
    graph, _ = _graph()
    rooms = defaultdict(set)
    for a, bs in graph.items():
        for b in bs:
            if _room(a) != _room(b) and _room(a) != "muser":
                rooms[_room(a)].add(_room(b))
    assert _cycles(rooms) == [], dict(rooms)


def test_function_local_imports_have_a_reason():
    _, local = _graph()
    unexplained = [
        f"{module}:{line} imports {target}" for module, target, line in local
        if target.split(".")[0] not in OPTIONAL and not any(
            target == m or target.startswith(m + ".") for m in LAZY_MODULES)
        and module != "muser"]
    assert unexplained == []
