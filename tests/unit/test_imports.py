"""Dependencies point one way (DESIGN.md, "Boundaries and their types"): no package-level import cycles,
no upward imports, no import cycles between modules, model code free of the forward context, task services
that reach the engine core only through their port, and the scheduler, the shared types and image preprocessing
free of torch (the roles' boundaries: test_boundaries.py).

Imports are read from the source with `ast`. Run-time imports are module-level imports and imports inside
functions; the module-cycle, forward-context and port checks also count imports under `if TYPE_CHECKING:`
(a cycle that only the type checker sees is still a cycle in the design).
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import pkgutil
import subprocess
import sys
from collections import defaultdict, deque
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

import embedserv

# Each package may import itself, the packages below it here (transitively) and the SHARED leaves.
BELOW: dict[str, set[str]] = {
    "__main__": {"cli"},
    "cli": {"server", "config_file", "cli_parser", "batch"},
    "cli_parser": {"batch"},  # the serve and batch commands' flags
    "batch": {"server", "engine"},  # embedserv batch: the engine in process; OpenAI batch files through the HTTP app
    "config_file": set(),  # the YAML reader of `serve --config`: only the command line reads it
    "server": {"engine", "v1", "tei"},  # server/http: the HTTP APIs are part of the server's edge
    "engine": {"executor"},
    "executor": {"worker"},
    "worker": {"models", "attention"},
    "models": {"attention"},  # a model is built from Attention layers
    "attention": set(),
    "v1": set(),  # the generated gRPC stubs
    "tei": set(),  # TEI's generated gRPC stubs (tei.v1)
}
# Anyone may import these; they import only each other. "embedserv" is the root __init__ (__version__).
SHARED = {
    "embedserv",
    "types",
    "steps",
    "scheduler",
    "config",
    "errors",
    "logs",
    "call_class",
    "api_keys",
    "metrics",
    "forward_context",
    "cpu_isa",
    "sizes",
    "memory_ceiling",
    "start_up",
    "tracing",
}
REPO = Path(__file__).resolve().parents[2]


def _raise(name: str) -> None:
    raise ImportError(f"cannot import package {name} to list its modules")


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """Every embedserv module: name -> (source file, is a package)."""
    found = {"embedserv": (Path(embedserv.__file__), True)}
    for info in pkgutil.walk_packages(embedserv.__path__, "embedserv.", onerror=_raise):
        optional = info.name == "embedserv.attention.backends.flash_attn"
        if optional and importlib.util.find_spec("flash_attn") is None:
            continue
        found[info.name] = (Path(info.module_finder.find_spec(info.name).origin), info.ispkg)
    return found


def package(module: str) -> str:
    """embedserv.engine.engine -> engine; embedserv.types -> types; embedserv -> embedserv."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _import_nodes(node: ast.AST, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    type_checking_only = isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking
    for child in node.orelse if type_checking_only else ast.iter_child_nodes(node):
        yield from _import_nodes(child, type_checking)


@cache
def imports(module: str, type_checking: bool = False) -> frozenset[str]:
    """The run-time imports of a module (with `type_checking`, those under `if TYPE_CHECKING:` too):
    embedserv modules by full name, anything else by top-level name."""
    path, is_package = modules()[module]
    parent = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = importlib.util.resolve_name("." * node.level + (node.module or ""), parent)
        # `from package import name`: name may be a submodule; if it is not, base is what runs.
        names.add(base)
        names.update(f"{base}.{alias.name}" for alias in node.names)
    internal = {n for n in names if n in modules()}
    external = {n.split(".")[0] for n in names if n.split(".")[0] != "embedserv"}
    return frozenset(internal | external)


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> the module-level evidence, "a.b imports c.d"."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module in modules():
        for target in sorted(imports(module)):
            if target in modules() and package(target) != package(module):
                edges[package(module), package(target)].append(f"{module} imports {target}")
    return edges


def _shortest_cycle(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return None


def test_no_package_level_import_cycles() -> None:
    edges = package_edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    cycles = {}
    for start in sorted(graph):
        cycle = _shortest_cycle(start, graph)
        if cycle is not None:
            # One entry per cycle, whichever package it was found from.
            rotation = min(range(len(cycle) - 1), key=lambda i: cycle[i])
            cycles[tuple(cycle[rotation:-1] + cycle[: rotation + 1])] = None
    report = []
    for cycle in cycles:
        report.append(" -> ".join(cycle))
        report.extend(f"    {why}" for a, b in itertools.pairwise(cycle) for why in edges[a, b])
    assert not report, "package-level import cycles:\n" + "\n".join(report)


def _allowed(importer: str, imported: str) -> bool:
    if imported in SHARED:
        return True
    if importer in SHARED:
        return False
    below, todo = set(), list(BELOW.get(importer, ()))
    while todo:
        name = todo.pop()
        if name not in below:
            below.add(name)
            todo.extend(BELOW.get(name, ()))
    return imported in below


def test_imports_point_down() -> None:
    unknown = sorted({package(m) for m in modules()} - SHARED - BELOW.keys())
    report = [f"{name} is missing from the table in this test" for name in unknown]
    for (a, b), why in sorted(package_edges().items()):
        if not _allowed(a, b):
            report.append(f"{a} -> {b} is not allowed:")
            report.extend(f"    {line}" for line in why)
    assert not report, "imports against the allowed direction:\n" + "\n".join(report)


def internal_imports(module: str) -> set[str]:
    """The embedserv modules a module imports in any way: at run time, inside functions, for the type checker."""
    return {name for name in imports(module, type_checking=True) if name in modules() and name != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = {stack.pop()}
                    while node not in component:
                        component.add(stack.pop())
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    cycles = []
    for component in components:
        if len(component) > 1:
            inside = {node: graph[node] & component for node in component}
            cycles.append(_shortest_cycle(min(component), inside))
    return sorted(cycles)


def test_no_module_import_cycles() -> None:
    graph = {module: internal_imports(module) for module in modules()}
    report = [" -> ".join(cycle) for cycle in _cycles(graph)]
    assert not report, "import cycles between modules (TYPE_CHECKING and local imports count):\n" + "\n".join(report)


def test_the_cycle_finder_finds_a_cycle_behind_a_local_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


# The one model module that reads the context: LoraLinear finds its step's rows per --lora adapter there, as
# Attention finds its metadata, so that no family's code passes adapters down its layers.
_READS_THE_CONTEXT = {"embedserv.models.lora"}


def test_model_code_does_not_import_the_forward_context() -> None:
    """Models know nothing of attention metadata or KV caches (DESIGN.md, "Forward context"): only
    attention/layer.py (and the LoRA layer, models/lora.py) reads the context."""
    report = [
        module
        for module in modules()
        if module.startswith("embedserv.models.")
        and module not in _READS_THE_CONTEXT
        and "embedserv.forward_context" in internal_imports(module)
    ]
    assert not report, "model code that imports embedserv.forward_context:\n" + "\n".join(report)


_LOADING_TYPES = {"embedserv.models.loading", "embedserv.models.loading.family"}


def _layout_breaches(module: str) -> set[str]:
    imported = internal_imports(module)
    if module.startswith("embedserv.models.families."):
        return {
            m
            for m in imported
            if m.startswith(("embedserv.models.heads", "embedserv.models.registry"))
            or (m.startswith("embedserv.models.loading") and m not in _LOADING_TYPES)
        }
    if module.startswith("embedserv.models.heads."):
        return {m for m in imported if m.startswith(("embedserv.models.families", "embedserv.models.registry"))}
    return set()


def test_families_and_heads_stay_apart() -> None:
    """A family file (models/families/) imports no head, not the registry, and of models/loading only the
    record types; a head (models/heads/) imports no family and not the registry. So a new family is one
    file plus a registry line, and a new head one file plus its registry entry (DESIGN.md, "Layout")."""
    report = [f"{module} imports {', '.join(sorted(bad))}" for module in modules() if (bad := _layout_breaches(module))]
    assert not report, "models/ layout breaches:\n" + "\n".join(report)


def _defines_class(module: str, names: set[str]) -> bool:
    tree = ast.parse(modules()[module][0].read_text())
    return any(isinstance(node, ast.ClassDef) and node.name in names for node in tree.body)


def test_task_services_reach_the_engine_only_through_their_port() -> None:
    """engine/tasks/ never imports, even through other modules, the Engine facade (whichever module defines
    Engine or SyncEngine) or the engine core (engine/core/): the services get a port (engine/ports.py)."""
    facade = {module for module in modules() if _defines_class(module, {"Engine", "SyncEngine"})}
    assert "embedserv.engine.engine" in facade, "the Engine facade moved: update this test"
    forbidden = facade | {module for module in modules() if module.startswith("embedserv.engine.core")}
    report = []
    for start in sorted(m for m in modules() if m.startswith("embedserv.engine.tasks.")):
        came_from: dict[str, str | None] = {start: None}
        queue = deque([start])
        while queue:
            module = queue.popleft()
            if module in forbidden:
                chain = [module]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                report.append(" -> ".join(reversed(chain)))
                break
            for nxt in sorted(internal_imports(module) - came_from.keys()):
                came_from[nxt] = module
                queue.append(nxt)
    assert not report, "task services that reach the engine past their port:\n" + "\n".join(report)


def _torch_free_modules() -> list[str]:
    """Listed from the files, so that collecting this test imports nothing."""
    scheduler = pkgutil.iter_modules([str(REPO / "embedserv" / "scheduler")], "embedserv.scheduler.")
    # Image decoding and preprocessing run in the front end's pool: numpy and Pillow only.
    images_dir = REPO / "embedserv" / "engine" / "inputs" / "images"
    images = pkgutil.iter_modules([str(images_dir)], "embedserv.engine.inputs.images.")
    return [
        "embedserv.types",
        "embedserv.steps",
        "embedserv.scheduler",
        *sorted(info.name for info in scheduler),
        "embedserv.engine.inputs.images",
        *sorted(info.name for info in images),
        # Token classification's entities (the pipeline's aggregation): numpy only.
        "embedserv.engine.tasks.entities",
        # M-RoPE positions are computed on the host per step: numpy only.
        "embedserv.models.mrope",
    ]


def _runs_first(module: str) -> list[str]:
    """Importing a module runs its parent packages' __init__ too."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_torch_free_modules_import_no_torch_by_source() -> None:
    report = []
    for start in _torch_free_modules():
        came_from: dict[str, str | None] = {start: None}
        queue = deque([start])
        while queue:
            module = queue.popleft()
            if "torch" in imports(module):
                chain = [module]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                report.append(" -> ".join([*reversed(chain), "torch"]))
                break
            for nxt in sorted(i for i in imports(module) | set(_runs_first(module)) if i in modules()):
                if nxt not in came_from:
                    came_from[nxt] = module
                    queue.append(nxt)
    assert not report, "torch-free modules that import torch:\n" + "\n".join(report)


@pytest.mark.parametrize("module", _torch_free_modules())
def test_torch_free_modules_import_no_torch_at_run_time(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing {module} loads torch: {result.stdout.strip()}"
