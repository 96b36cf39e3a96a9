"""Checks of a run's inputs made before any model or worker starts: the model, tokenizer and data
exist, the config's functions import and take one argument (on this machine, from the directory the
run is launched from), and the code the workers would receive can be shipped."""

from __future__ import annotations

import fsspec

from engine.config import TrellisConfig
from engine.rollout.rewards import resolve_function
from engine.run.code_bundle import (
    CodeBundleError,
    launch_directory,
    shipped_code,
    user_function_specs,
)
from engine.user_code import UserCodeError


class InputError(ValueError):
    """An input of the run (model, tokenizer, dataset, reward function) cannot be used."""


def check_inputs(config: TrellisConfig) -> None:
    problems: list[str] = []
    for name, uri, marker in (
        ("load_from", config.load_from, "config.json"),
        ("tokenizer_path", config.tokenizer_source, None),
    ):
        problem = _missing(uri, marker, config.storage_options)
        if problem:
            problems.append(f"{name}: {problem}")
    for name, dataset in (("train_dataset", config.train_dataset), ("eval_dataset", config.eval_dataset)):
        if dataset is not None:
            problem = _missing(dataset.path, None, dataset.storage_options)
            if problem:
                problems.append(f"{name}.path: {problem}")
    for spec in user_function_specs(config):
        try:
            resolve_function(spec, launch_directory(config))
        except UserCodeError as error:
            problems.append(f"reward: {error}")
    try:
        shipped_code(config)
    except CodeBundleError as error:
        problems.append(f"cluster.code_dir: {error}")
    if problems:
        raise InputError("Cannot start the run:\n" + "\n".join(f"  - {p}" for p in problems))


def _missing(uri: str, marker: str | None, storage_options: dict[str, str]) -> str | None:
    try:
        fs, path = fsspec.core.url_to_fs(uri, **storage_options)
        if not fs.exists(path):
            return f"{uri} does not exist"
        if marker and not fs.exists(f"{path.rstrip('/')}/{marker}"):
            return f"{uri} has no {marker}; is it an HF checkpoint folder (save_pretrained output)?"
    except (OSError, ValueError, ImportError) as error:
        return f"cannot open {uri}: {error}"
    return None
