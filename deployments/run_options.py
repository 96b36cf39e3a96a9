"""Options shared by the operator commands that read a run (``runs``, ``trajectories``, ``report``,
``lineage``): where runs live and how to reach that storage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trellis.engine.storage.runs import RunRef, locate_run
from trellis.engine.storage.store import Store

WorkDirOption = Annotated[
    Optional[str], typer.Option("--work-dir", help="Where runs live (any fsspec URI); default: the config's, else work_dirs.")
]
ConfigOption = Annotated[
    Optional[Path], typer.Option("--config", help="Take work_dir and storage_options from this run config.")
]
StorageOption = Annotated[
    list[str], typer.Option("--storage-option", "-o", help="fsspec option key=value, e.g. -o endpoint_url=http://minio:9000.")
]


def storage_location(work_dir: str | None, config: Path | None, options: list[str]) -> tuple[str, dict]:
    """(work_dir, storage_options) from the options; credentials stay in the environment."""
    storage: dict = {}
    if config is not None:
        from trellis.engine.config.loading import load_config

        cfg = load_config(config)
        storage.update(cfg.storage_options)
        work_dir = work_dir or cfg.work_dir
    for option in options:
        key, equals, value = option.partition("=")
        if not equals or not key:
            raise typer.BadParameter(f"{option!r}: a storage option is key=value.")
        storage[key] = value
    return work_dir or "work_dirs", storage


def run_ref(run: str, work_dir: str | None, config: Path | None, options: list[str]) -> RunRef:
    root, storage = storage_location(work_dir, config, options)
    return locate_run(run, work_dir=Store(root, storage))
