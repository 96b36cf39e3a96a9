"""Imports go one way (deployments -> flows -> tasks -> engine); engine works without Prefect."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "engine": {"prefect", "tasks", "flows", "deployments"},
    "tasks": {"flows", "deployments"},
    "flows": {"torch", "deployments"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_down(layer):
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_roots(path) & FORBIDDEN[layer])
        for path in (ROOT / layer).rglob("*.py")
        if imported_roots(path) & FORBIDDEN[layer]
    }
    assert offenders == {}
