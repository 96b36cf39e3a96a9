"""The house rules a reader relies on, checked by parsing imports: deployments -> flows -> tasks ->
engine; Ray only in engine/cluster; vLLM only in its backend; no transformers in engine/algo;
Prefect only in flows/, tasks/ and deployments/; flows take from the engine only its configs, plans
and result types (the step's order and the run around the steps included: they are the engine's,
``engine.run.step`` and ``engine.run.loop``); engine/rollout's concerns import down and its modules in
no circle; no code compares a rollout backend's name."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "tasks", "flows", "deployments")
# engine.run.loop: the run around the steps (run_steps) is the engine's as the step's order is, shared
# with the in-process runner; the flow adds only Prefect around it.
FLOWS_MAY_IMPORT = {"engine.config", "engine.run.plan", "engine.run.step", "engine.run.loop", "engine.run.metrics"}


def written_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def imported_modules(path: Path) -> set[str]:
    """The modules ``path`` imports, trellis's named by their layer (trellis.engine.x -> engine.x)."""
    return {name.removeprefix("trellis.") for name in written_imports(path)}


def sources(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def offenders(paths: list[Path], forbidden, imports=imported_modules) -> dict[str, list[str]]:
    found = {}
    for path in paths:
        bad = sorted(name for name in imports(path) if forbidden(name))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def root_of(name: str) -> str:
    return name.split(".")[0]


def test_trellis_is_imported_by_its_one_name():
    """trellis's packages are trellis.engine, trellis.tasks, ...: a bare ``import engine`` would load a
    second copy of a module (two classes for one isinstance, two registries) where the checkout is on
    sys.path, and a user's own ``tasks`` package wherever a project has one."""
    paths = [path for folder in (*LAYERS, "bench", "tests", "examples", "docs") for path in sorted((ROOT / folder).rglob("*.py"))]
    assert offenders(paths, lambda name: root_of(name) in LAYERS, written_imports) == {}


@pytest.mark.parametrize(
    "layer, forbidden_roots",
    [
        ("engine", {"prefect", "tasks", "flows", "deployments"}),
        ("tasks", {"flows", "deployments", "ray"}),
        ("flows", {"torch", "ray", "deployments"}),
        ("deployments", {"ray"}),
    ],
)
def test_layer_imports_point_down(layer, forbidden_roots):
    assert offenders(sources(layer), lambda name: root_of(name) in forbidden_roots) == {}


def test_ray_is_imported_only_by_the_cluster_package():
    outside = [path for path in sources(*LAYERS) if not path.is_relative_to(ROOT / "engine" / "cluster")]
    assert offenders(outside, lambda name: root_of(name) == "ray") == {}


def test_vllm_is_imported_only_by_its_backend():
    outside = [path for path in sources(*LAYERS) if path != ROOT / "engine" / "rollout" / "backends" / "vllm_backend.py"]
    assert offenders(outside, lambda name: root_of(name) == "vllm") == {}


def test_algorithms_are_pure_torch():
    assert offenders(sources("engine/algo"), lambda name: root_of(name) in {"transformers", "ray", "fsspec"}) == {}


def test_flows_take_only_configs_plans_and_result_types_from_the_engine():
    def forbidden(name: str) -> bool:
        return root_of(name) == "engine" and not any(name == allowed or name.startswith(f"{allowed}.") for allowed in FLOWS_MAY_IMPORT)

    assert offenders(sources("flows"), forbidden) == {}


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of imports in ``graph`` (module -> the modules it imports), each as its path."""
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            cycles.append(trail[trail.index(node):] + [node])
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, trail + [node])

    for start in sorted(graph):
        visit(start, [])
    return cycles


def engine_package(path: Path) -> str:
    """engine/train/worker.py -> engine.train; engine/secrets.py -> engine.secrets (a module of its own)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:2]) if parts[-1] != "__init__" else ".".join(parts[:-1])


def test_the_engine_packages_depend_on_each_other_without_cycles():
    """Each folder of engine/ can be read (and tested) knowing only those below it."""
    graph: dict[str, set[str]] = {}
    for path in sources("engine"):
        package = engine_package(path)
        for name in imported_modules(path):
            if root_of(name) == "engine" and name != "engine":
                target = ".".join(name.split(".")[:2])
                if target != package:
                    graph.setdefault(package, set()).add(target)
    assert cycles_in(graph) == []


ROLLOUT_ORDER = {"bounded_calls": 0, "backends": 1, "agents": 2, "rewards": 2, "production": 3}


def rollout_module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rollout_imports(path: Path) -> set[str]:
    """The engine.rollout modules ``path`` imports anywhere: at module level, under TYPE_CHECKING or
    deferred inside a function (``from package import module`` counts the module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name.removeprefix("trellis.") for name in names if name.startswith("trellis.engine.rollout.")}


def test_the_rollout_subpackages_import_down_and_their_modules_in_no_circle():
    """backends, then agents and rewards, then production: each concern can be read knowing only those
    below it, and no import, however deferred, closes a circle (one did: produce <-> agent_loops)."""
    paths = sources("engine/rollout")
    modules = {rollout_module(path) for path in paths}
    graph = {rollout_module(path): rollout_imports(path) & modules - {rollout_module(path)} for path in paths}
    concern = {module: module.split(".")[2] for module in modules if module != "engine.rollout"}
    assert set(concern.values()) == set(ROLLOUT_ORDER)
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if a in concern and concern[a] != concern[b] and ROLLOUT_ORDER[concern[a]] <= ROLLOUT_ORDER[concern[b]])
    assert upward == []
    assert cycles_in(graph) == []


def test_no_code_asks_for_a_rollout_backend_by_its_name():
    """What a backend needs or can do is a field of its registry entry (engine.config.backends), never a
    comparison such as ``config.rollout.backend == "vllm"``, so adding a backend adds a row."""
    from trellis.engine.config.backends import configurable_backends

    names = configurable_backends()

    def names_a_backend(node: ast.expr) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_a_backend(element) for element in node.elts)
        return isinstance(node, ast.Constant) and node.value in names

    found = []
    for path in sources(*LAYERS):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(names_a_backend(side) for side in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.MatchValue) and names_a_backend(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
