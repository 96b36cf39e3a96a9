"""Checks of a run's inputs made before any model or worker starts: the model, tokenizer and data
exist, the config's functions import and take one argument (on this machine, from the directory the
run is launched from), and the code the workers would receive can be shipped."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig

from trellis.engine.config import DatasetConfig, TrellisConfig
from trellis.engine.vision.models import policy_auto_class
from trellis.engine.errors import SettingError
from trellis.engine.moe.checks import moe_setting_problems
from trellis.engine.moe.routers import config_moe_shape
from trellis.engine.run.code_bundle import CodeBundleError, launch_directory, shipped_code
from trellis.engine.storage.store import Store
from trellis.engine.train.lora import linear_names, unmatched_problem, unmatched_targets
from trellis.engine.run.user_code_checks import user_code_checks, user_code_problems


class InputError(SettingError):
    """An input of the run (model, tokenizer, dataset, reward function) cannot be used."""


def check_inputs(config: TrellisConfig) -> None:
    problems: list[str] = []
    for name, uri, marker in (
        ("load_from", config.load_from, "config.json"),
        ("tokenizer_path", config.tokenizer_source, None),
    ):
        problem = _missing(Store(uri, config.storage_options), marker)
        if problem:
            problems.append(f"{name}: {problem}")
    for name, dataset in _datasets(config):
        if dataset.path is None:
            continue  # an hf dataset: a name or a local folder datasets reads, with its own errors
        problem = _missing(Store(dataset.path, dataset.storage_options), None)
        if problem:
            problems.append(f"{name}.path: {problem}")
    if not problems:
        problems += _policy_problems(config)
    problems += user_code_problems(user_code_checks(config), launch_directory(config))
    try:
        shipped_code(config)
    except CodeBundleError as error:
        problems.append(f"cluster.code_dir: {error}")
    if problems:
        raise InputError("Cannot start the run:\n" + "\n".join(f"  - {p}" for p in problems))


def _datasets(config: TrellisConfig) -> list[tuple[str, DatasetConfig]]:
    if not config.tasks:
        found = [("train_dataset", config.train_dataset), ("eval_dataset", config.eval_dataset)]
    else:
        found = [(f"tasks[{t.name}].{key}", getattr(t, key)) for t in config.tasks for key in ("train_dataset", "eval_dataset")]
    return [(name, dataset) for name, dataset in found if dataset is not None]


def _policy_problems(config: TrellisConfig) -> list[str]:
    """Settings the policy's architecture must allow (routing replay needs an MoE)."""
    try:
        with Store(config.load_from, config.storage_options).join("config.json").open("r") as handle:
            model = json.load(handle)
    except (OSError, ValueError) as error:
        return [f"load_from: cannot read its config.json: {error}"]
    name = ", ".join(model.get("architectures") or []) or str(model.get("model_type"))
    return moe_setting_problems(config, config_moe_shape(model) is not None, name) + _lora_problems(config, model, name)


def _lora_problems(config: TrellisConfig, model_json: dict, name: str) -> list[str]:
    """LoRA's target modules must name linear layers of the policy: checked on a weightless (meta) copy."""
    if config.lora is None:
        return []
    try:
        hf_config = AutoConfig.for_model(**model_json)
        with torch.device("meta"):
            model = policy_auto_class(hf_config).from_config(hf_config)
    except (ValueError, KeyError, TypeError) as error:
        return [f"lora: cannot build {name} from its config.json to check lora.target_modules: {error}"]
    unmatched = unmatched_targets(model, config.lora)
    return [unmatched_problem(unmatched, linear_names(model), f"{config.load_from} ({name})")] if unmatched else []


def _missing(location: Store, marker: str | None) -> str | None:
    uri = location.uri
    try:
        fs, path = location.fs()
        if not fs.exists(path):
            return f"{uri} does not exist"
        if marker and not fs.exists(f"{path.rstrip('/')}/{marker}"):
            return f"{uri} has no {marker}; is it an HF checkpoint folder (save_pretrained output)?"
    except (OSError, ValueError, ImportError) as error:
        return f"cannot open {uri}: {error}"
    return None
