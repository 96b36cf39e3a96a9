"""Prompt rows from a Hugging Face dataset (``train_dataset.hf``), through the ``datasets`` library.

A folder written by ``save_to_disk`` is loaded as it is; any other folder, a data file or a hub name
goes through ``load_dataset`` (a hub name needs a reachable hub, or the dataset in the local cache).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from trellis.engine.config import DatasetConfig
from trellis.engine.errors import DatasetError

_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def hf_rows(config: DatasetConfig) -> Iterator[dict[str, Any]]:
    """The rows of ``config.hf``'s split, as dicts."""
    try:
        import datasets
    except ImportError as error:
        raise DatasetError(f"{config.source}: reading hf datasets needs the datasets package: pip install datasets ({error})") from error
    dataset = _split(_load(datasets, config), config)
    for row in dataset:
        yield dict(row)


def _load(datasets: Any, config: DatasetConfig) -> Any:
    name = config.hf
    try:
        if os.path.isdir(name) and _saved_to_disk(name):
            return datasets.load_from_disk(name)
        if os.path.isfile(name):
            builder = _FILE_BUILDERS.get(os.path.splitext(name)[1])
            if builder is None:
                raise DatasetError(f"{config.source}: cannot tell the format of {name}; use {', '.join(_FILE_BUILDERS)}")
            return datasets.load_dataset(builder, data_files={config.split: name})
        return datasets.load_dataset(name, config.hf_subset)
    except DatasetError:
        raise
    except Exception as error:  # datasets raises many kinds: not found, offline, bad subset, unreadable file
        where = "a local folder or file" if os.path.exists(name) else "not a local folder or file, and the hub did not give it"
        raise DatasetError(f"{config.source}: cannot load the dataset ({where}): {type(error).__name__}: {error}") from error


def _saved_to_disk(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, marker)) for marker in ("dataset_dict.json", "state.json"))


def _split(loaded: Any, config: DatasetConfig) -> Any:
    if not hasattr(loaded, "keys"):  # a single Dataset (save_to_disk of one split): its split is whatever it is
        return loaded
    if config.split not in loaded:
        raise DatasetError(f"{config.source}: no split {config.split!r}; it has {', '.join(sorted(loaded))}")
    return loaded[config.split]
