"""trellis installs as one package, ``trellis``, whose ``engine``, ``tasks``, ``flows`` and
``deployments`` keep their folders at the repository's top level (pyproject.toml maps them): an
editable install, a wheel and a checkout on PYTHONPATH (the GPU benches) all import ``trellis.engine``,
and none claims the bare names a user's project folder may use for packages of its own."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "tasks", "flows", "deployments")
# Imported where the user's own engine/ and tasks/ come first on sys.path: each must be trellis's.
PROBE = """
import sys, engine, tasks
import trellis.engine.config, trellis.tasks.step_tasks
assert engine.USER and tasks.USER, (engine.__file__, tasks.__file__)
print(trellis.engine.config.__file__)
"""


def user_folder(tmp_path: Path) -> Path:
    for name in ("engine", "tasks"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "__init__.py").write_text("USER = True\n")
    return tmp_path


def isolated_import(folder: Path, *path: Path) -> str:
    """PROBE run in ``folder`` with only ``path`` and the dependencies importable: ``-S`` leaves out the
    site's .pth files, among them the editable install's finder."""
    entries = [str(folder), *map(str, path), sysconfig.get_paths()["purelib"]]
    result = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=folder, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": ":".join(entries)})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_pyproject_maps_every_package_folder_under_trellis():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = sorted(path.parent.relative_to(ROOT).as_posix().replace("/", ".")
                     for layer in LAYERS for path in (ROOT / layer).rglob("__init__.py"))
    assert sorted(setuptools["packages"]) == sorted(["trellis", *(f"trellis.{name}" for name in folders)])
    assert setuptools["package-dir"] == {"trellis": "trellis", **{f"trellis.{layer}": layer for layer in LAYERS}}


def test_a_wheel_holds_the_packages_under_trellis_and_imports_beside_a_users_own(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("trellis-*.whl")))
    names = set(wheel.namelist())
    sources = {f"trellis/{path.relative_to(ROOT).as_posix()}" for layer in LAYERS for path in (ROOT / layer).rglob("*.py")}
    assert sources <= names
    assert "trellis/flows/one_root_certificate.pem" in names  # package data: flows.prefect_settings reads it
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"trellis"}
    wheel.extractall(tmp_path / "site")
    imported = isolated_import(user_folder(tmp_path / "project"), tmp_path / "site")
    assert Path(imported) == tmp_path / "site" / "trellis" / "engine" / "config" / "__init__.py"


def test_a_checkout_on_pythonpath_imports_trellis_without_installing(tmp_path):
    imported = isolated_import(user_folder(tmp_path), ROOT)
    assert Path(imported) == ROOT / "engine" / "config" / "__init__.py"


def test_the_editable_install_claims_no_bare_name(tmp_path):
    result = subprocess.run([sys.executable, "-c", "import importlib.util as u; print([n for n in ('engine', 'tasks', 'flows', "
                             "'deployments') if u.find_spec(n)]); import trellis.engine.config"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr
