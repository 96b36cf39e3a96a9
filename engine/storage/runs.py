"""Finding a run's folder from what an operator types: a run name under a work_dir, or the run's own
URI (a local path or ``s3://...``), optionally with ``@STEP``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import fsspec

# A folder is a run's when it holds one of these (written by every run that got past its start).
RUN_MARKERS = ("logs", "trajectories", "checkpoints")


class RunNotFoundError(LookupError):
    """The run (or the step of it) an operator named does not exist."""


@dataclass(frozen=True)
class RunRef:
    uri: str
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    def filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, path = fsspec.core.url_to_fs(self.uri, **self.storage_options)
        fs.invalidate_cache()
        return fs, path


def is_run_folder(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    return any(fs.exists(f"{path.rstrip('/')}/{marker}") for marker in RUN_MARKERS)


def run_folders(work_dir: str, storage_options: dict[str, Any] | None = None) -> list[RunRef]:
    """The runs directly under ``work_dir``, by name."""
    options = dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(work_dir, **options)
    fs.invalidate_cache()
    if not fs.exists(root):
        raise RunNotFoundError(f"work_dir {work_dir} does not exist.")
    runs = []
    for entry in sorted(fs.ls(root, detail=True), key=lambda e: e["name"]):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry["type"] == "directory" and is_run_folder(fs, entry["name"]):
            runs.append(RunRef(f"{work_dir.rstrip('/')}/{name}", options))
    return runs


def locate_run(run: str, *, work_dir: str = "work_dirs", storage_options: dict[str, Any] | None = None) -> RunRef:
    """``run`` is a run name under ``work_dir`` or a run folder's URI; a clear error if neither exists."""
    options = dict(storage_options or {})
    looks_like_uri = "/" in run or "://" in run
    uri = run.rstrip("/") if looks_like_uri else f"{work_dir.rstrip('/')}/{run}"
    fs, path = fsspec.core.url_to_fs(uri, **options)
    fs.invalidate_cache()
    if fs.exists(path) and is_run_folder(fs, path):
        return RunRef(uri, options)
    if looks_like_uri:
        raise RunNotFoundError(f"No run at {uri}: it holds no logs/, trajectories/ or checkpoints/.")
    try:
        known = [ref.name for ref in run_folders(work_dir, options)]
    except RunNotFoundError as missing_work_dir:
        raise RunNotFoundError(f"No run named {run!r}: {missing_work_dir}") from None
    hint = f" Runs there: {', '.join(known)}." if known else " There are no runs there."
    raise RunNotFoundError(f"No run named {run!r} under {work_dir}.{hint}")


def split_run_step(text: str) -> tuple[str, int | None]:
    """``RUN@STEP`` -> (RUN, STEP); ``RUN`` -> (RUN, None)."""
    run, at, step = text.rpartition("@")
    if not at:
        return text, None
    if not step.isdigit():
        raise ValueError(f"{text!r}: the part after '@' must be a step number, as in my_run@10.")
    return run, int(step)
