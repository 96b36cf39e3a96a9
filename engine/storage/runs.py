"""Finding a run's folder from what an operator types: a run name under a work_dir, or the run's own
URI (a local path or ``s3://...``), optionally with ``@STEP``."""

from __future__ import annotations

from dataclasses import dataclass

import fsspec

from trellis.engine.storage.store import Store

# A folder is a run's when it holds one of these (written by every run that got past its start).
RUN_MARKERS = ("logs", "trajectories", "checkpoints")


class RunNotFoundError(LookupError):
    """The run (or the step of it) an operator named does not exist."""


@dataclass(frozen=True, eq=False)
class RunRef(Store):
    """A run's folder, found from what an operator typed: a Store with the run's name."""

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    def filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, path = self.fs()
        fs.invalidate_cache()
        return fs, path


def is_run_folder(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    return any(fs.exists(f"{path.rstrip('/')}/{marker}") for marker in RUN_MARKERS)


def run_folders(work_dir: Store) -> list[RunRef]:
    """The runs directly under ``work_dir``, by name."""
    fs, root = work_dir.fs()
    fs.invalidate_cache()
    if not fs.exists(root):
        raise RunNotFoundError(f"work_dir {work_dir.uri} does not exist.")
    runs = []
    for entry in sorted(fs.ls(root, detail=True), key=lambda e: e["name"]):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry["type"] == "directory" and is_run_folder(fs, entry["name"]):
            runs.append(RunRef(work_dir.join(name).uri, work_dir.options))
    return runs


def locate_run(run: str, *, work_dir: Store) -> RunRef:
    """``run`` is a run name under ``work_dir`` or a run folder's URI (reached with ``work_dir``'s
    options); a clear error if neither exists."""
    looks_like_uri = "/" in run or "://" in run
    found = RunRef(run.rstrip("/") if looks_like_uri else work_dir.join(run).uri, work_dir.options)
    fs, path = found.filesystem()
    uri = found.uri
    if fs.exists(path) and is_run_folder(fs, path):
        return found
    if looks_like_uri:
        raise RunNotFoundError(f"No run at {uri}: it holds no logs/, trajectories/ or checkpoints/.")
    try:
        known = [ref.name for ref in run_folders(work_dir)]
    except RunNotFoundError as missing_work_dir:
        raise RunNotFoundError(f"No run named {run!r}: {missing_work_dir}") from None
    hint = f" Runs there: {', '.join(known)}." if known else " There are no runs there."
    raise RunNotFoundError(f"No run named {run!r} under {work_dir.uri}.{hint}")


def split_run_step(text: str) -> tuple[str, int | None]:
    """``RUN@STEP`` -> (RUN, STEP); ``RUN`` -> (RUN, None)."""
    run, at, step = text.rpartition("@")
    if not at:
        return text, None
    if not step.isdigit():
        raise ValueError(f"{text!r}: the part after '@' must be a step number, as in my_run@10.")
    return run, int(step)
