"""What a newcomer can read: no module past ~400 lines, no function past ~60, and the lint rules of
pyproject.toml's [tool.ruff] met everywhere (bench/ and tests/ included)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "tasks", "flows", "deployments")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def python_files() -> list[Path]:
    return [path for layer in LAYERS for path in sorted((ROOT / layer).rglob("*.py"))]


def test_no_module_is_past_four_hundred_lines():
    long = {str(p.relative_to(ROOT)): n for p in python_files() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_past_sixty_lines():
    long = {}
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}::{node.name}"] = lines
    assert long == {}


def test_the_code_meets_its_lint_rules():
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
