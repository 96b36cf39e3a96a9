"""The user's code a run ships to its workers: the directory the run is launched from, as a zip that
Ray unpacks as each worker's working directory. Left out: what the config points at (model, data, run
outputs; the workers read those from their own paths), model-weight files, version-control and
virtual-environment folders, caches, and whatever the directory's ``.gitignore`` and
``cluster.code_excludes`` name.

A function whose module the driver imports from outside the launch folder and outside the Python
installation (a folder on ``PYTHONPATH``, a source checkout installed in editable mode) ships too: its
top-level package (or the module's own file) as a zip of its own, which Ray puts on the workers'
``sys.path`` (``py_modules``), with the same excludes and size limit.

What is shipped is what is hashed: the digest covers the exact file names and contents, so workers
built from other code are recognised when a later run finds them alive.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import site
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import pathspec

from trellis.engine.config import TrellisConfig
from trellis.engine.user_code import first_on_path, is_file_spec, origin, split_spec

ALWAYS_EXCLUDED = (
    ".git/", ".hg/", ".svn/", ".venv/", "venv/", "__pycache__/", "*.pyc", ".pytest_cache/", ".mypy_cache/",
    ".ruff_cache/", ".ipynb_checkpoints/", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx",
    "wandb/", "mlruns/",
)
MAX_BUNDLE_BYTES = 100 << 20
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed, so the same files make the same zip


class CodeBundleError(ValueError):
    """The launch directory cannot be shipped as it is."""


@dataclass(frozen=True)
class CodeBundle:
    root: str  # the directory it was made from
    zip_path: str | None  # a local zip: the workers' working_dir (None: no function lives in the launch folder)
    digest: str  # sha256 over the shipped files' names and contents
    files: int
    size_bytes: int
    modules: tuple[str, ...] = ()  # local zips of packages from outside the launch folder: the workers' py_modules
    module_sources: tuple[str, ...] = ()  # where each came from


def user_function_specs(config: TrellisConfig) -> tuple[str, ...]:
    """Every function the config names: reward functions, the tool loop's tools, the openai loop's agent,
    the group filter and the evaluation metric."""
    rewards = [spec for reward in config.rewards for spec in (reward.function, *reward.by_data_source.values())]
    agents = [spec for agent in config.agents for spec in (agent.tools, agent.entrypoint) if spec is not None]
    hooks = [spec for spec in (config.dynamic_sampling.group_filter, config.eval_metric) if spec]
    return tuple(dict.fromkeys(rewards + agents + hooks))


def launch_directory(config: TrellisConfig) -> Path:
    return Path(config.cluster.code_dir).resolve() if config.cluster.code_dir else Path.cwd().resolve()


def needs_shipping(specs: Iterable[str], launch_dir: Path) -> bool:
    """Whether some function lives in the launch directory (and not in trellis, which the cluster
    has installed); functions of installed packages need nothing shipped."""
    trellis_root = Path(__file__).resolve().parents[1]
    for spec in specs:
        found = origin(spec, launch_dir)
        if found is not None and found.is_relative_to(launch_dir) and not found.is_relative_to(trellis_root):
            return True
    return False


def shipped_code(config: TrellisConfig, out_dir: Path | None = None) -> CodeBundle | None:
    """The bundle this run's workers need, built (or reused) now; None when they need none."""
    launch_dir, specs = launch_directory(config), user_function_specs(config)
    outside = outside_packages(specs, launch_dir)
    in_launch_dir = needs_shipping(specs, launch_dir)
    if not in_launch_dir and not outside:
        return None
    out_dir = out_dir or Path(tempfile.gettempdir()) / "trellis-code"
    excludes = [*ALWAYS_EXCLUDED, *_named_by(config, launch_dir), *config.cluster.code_excludes]
    bundle = build_bundle(launch_dir, excludes=excludes, out_dir=out_dir) if in_launch_dir else CodeBundle(str(launch_dir), None, "", 0, 0)
    if not outside:
        return bundle
    modules = [build_bundle(path, excludes=[*ALWAYS_EXCLUDED, *config.cluster.code_excludes], out_dir=out_dir, top=path.name)
               for path in outside]
    digest = hashlib.sha256("".join([bundle.digest, *(module.digest for module in modules)]).encode()).hexdigest()
    return CodeBundle(bundle.root, bundle.zip_path, digest, bundle.files + sum(m.files for m in modules),
                      bundle.size_bytes + sum(m.size_bytes for m in modules), tuple(str(m.zip_path) for m in modules),
                      tuple(str(path) for path in outside))


def outside_packages(specs: Iterable[str], launch_dir: Path) -> list[Path]:
    """The top-level packages (folders) or modules (files) of ``specs`` that the driver imports from
    outside ``launch_dir``, trellis and the Python installation: the workers could not import them."""
    trellis_root = Path(__file__).resolve().parents[1]
    installed = [Path(p).resolve() for p in {sys.prefix, sys.base_prefix, *site.getsitepackages(), site.getusersitepackages()}]
    found: list[Path] = []
    for spec in specs:
        target = split_spec(spec)[0]
        if is_file_spec(target):
            continue
        path = origin(spec, launch_dir)
        if path is None or any(path.is_relative_to(root) for root in (launch_dir, trellis_root, *installed)):
            continue
        with first_on_path(launch_dir):
            top = importlib.util.find_spec(target.split(".")[0])
        locations = list(top.submodule_search_locations or []) if top is not None else []
        found.append(Path(locations[0]).resolve() if locations else path)
    return list(dict.fromkeys(found))


def build_bundle(root: Path, *, excludes: Sequence[str], out_dir: Path, top: str | None = None) -> CodeBundle:
    """The zip of ``root`` (a folder, or one module's file); with ``top``, its files go under that name in
    the zip, as a package on ``py_modules`` must."""
    files = [(root.name, root)] if root.is_file() else _selected_files(root, excludes)
    if top is not None and not root.is_file():
        files = [(f"{top}/{name}", path) for name, path in files]
    size = sum(path.stat().st_size for _, path in files)
    if size > MAX_BUNDLE_BYTES:
        largest = sorted(files, key=lambda item: item[1].stat().st_size, reverse=True)[:5]
        listed = ", ".join(f"{name} ({path.stat().st_size >> 20} MiB)" for name, path in largest)
        raise CodeBundleError(
            f"The run is launched from {root}, whose {len(files)} files ({size >> 20} MiB) would all be shipped to the "
            f"workers (at most {MAX_BUNDLE_BYTES >> 20} MiB). Largest: {listed}. Launch from your project's folder, "
            "or leave files out with cluster.code_excludes (gitignore patterns)."
        )
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    bundle = CodeBundle(str(root), str(out_dir / f"{digest.hexdigest()[:24]}.zip"), digest.hexdigest(), len(files), size)
    if not Path(bundle.zip_path).exists():
        _write_zip(files, Path(bundle.zip_path))
    return bundle


def _selected_files(root: Path, excludes: Sequence[str]) -> list[tuple[str, Path]]:
    ignore_file = root / ".gitignore"
    patterns = [*excludes, *(ignore_file.read_text().splitlines() if ignore_file.is_file() else [])]
    spec = pathspec.GitIgnoreSpec.from_lines(patterns)
    selected = []
    for folder, subfolders, names in os.walk(root):
        relative = Path(folder).relative_to(root)
        subfolders[:] = sorted(d for d in subfolders if not spec.match_file(f"{(relative / d).as_posix()}/"))
        for name in sorted(names):
            path = Path(folder) / name
            rel = (relative / name).as_posix()
            if path.is_file() and not spec.match_file(rel):
                selected.append((rel, path))
    return selected


def _write_zip(files: list[tuple[str, Path]], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, path in files:
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.external_attr = (path.stat().st_mode & 0o777) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    partial.replace(target)


def _named_by(config: TrellisConfig, root: Path) -> list[str]:
    """Gitignore patterns for the local paths the config reads or writes that lie inside ``root``."""
    datasets = [dataset.path or dataset.hf for dataset in (*config.train_datasets, *config.eval_datasets)]
    paths = [config.load_from, config.tokenizer_path, *datasets, config.work_dir, config.debug_rollout_dir]
    patterns = []
    for location in paths:
        if not location or "://" in location:
            continue
        path = Path(location).resolve()
        if path.is_relative_to(root) and path != root:
            patterns.append(f"/{path.relative_to(root).as_posix()}{'/' if path.is_dir() else ''}")
    return patterns
