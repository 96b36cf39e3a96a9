"""Load a ``TrellisConfig`` from YAML and ``key=value`` overrides, with errors a person can act on."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trellis.engine.config import TrellisConfig
from trellis.engine.config.rules import NO_REWARD
from trellis.engine.errors import SettingError


class ConfigError(SettingError):
    """A configuration that cannot be used; the message lists every problem found."""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, **fields: Any) -> TrellisConfig:
    """Read YAML (if given), apply ``a.b=value`` overrides and keyword fields, then validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {error}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of config keys, got {type(raw).__name__}.")
    return config_from_mapping(raw, overrides, **fields)


def config_from_mapping(raw: dict[str, Any], overrides: list[str] | None = None, **fields: Any) -> TrellisConfig:
    """As ``load_config``, from settings already read (a run's stored ``logs/config.json``)."""
    raw = copy.deepcopy(raw)
    for override in overrides or []:
        _apply_override(raw, override)
    raw.update(fields)
    return parse_config(raw)


def parse_config(raw: dict[str, Any]) -> TrellisConfig:
    """Validate, listing every problem: unknown keys stop pydantic before the cross-field rules run,
    so those are checked again on the config without them."""
    try:
        return TrellisConfig.model_validate(raw)
    except ValidationError as error:
        problems = describe_problems(error, TrellisConfig)
        if raw.get("train_dataset") is None and not raw.get("tasks") and not any("train_dataset" in p for p in problems):
            problems.append("train_dataset: required, but not set (or tasks, for a multi-task run)")
        reward = raw.get("reward")
        if not (isinstance(reward, dict) and reward.get("function")) and not raw.get("tasks") and not any("reward" in p for p in problems):
            problems.append(NO_REWARD)
        unknown = [item["loc"] for item in error.errors() if item["type"] == "extra_forbidden"]
        if unknown:
            try:
                TrellisConfig.model_validate(_without(raw, unknown))
            except ValidationError as rest:
                problems += [line for line in describe_problems(rest, TrellisConfig) if line not in problems]
        lines = "\n".join(f"  - {problem}" for problem in problems)
        raise ConfigError(f"Invalid configuration ({len(problems)} problem(s)):\n{lines}") from None


# Keys that an earlier trellis accepted (or that XTuner has and trellis does not yet), and what to do.
RETIRED = {
    "train_worker.share_prompt_prefix": "renamed; use train_worker.layout (shared_prefix for true, padded for false)",
}


def describe_problems(error: ValidationError, model: type[BaseModel]) -> list[str]:
    """One line per problem; a cross-field rule may report several at once, one per line."""
    lines = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden" and location in RETIRED:
            lines.append(f"{location}: {RETIRED[location]}")
        elif item["type"] == "extra_forbidden":
            lines.append(f"{location}: unknown key{_suggestion(model, item['loc'])}")
        elif item["type"] == "missing":
            lines.append(f"{location}: required, but not set")
        else:
            message = item["msg"].removeprefix("Value error, ")
            lines.extend(f"{location or 'config'}: {part}" for part in message.splitlines())
    return lines


def _without(raw: dict[str, Any], locations: list[tuple[Any, ...]]) -> dict[str, Any]:
    """A copy of ``raw`` without the keys at ``locations``."""
    stripped = copy.deepcopy(raw)
    for location in locations:
        node = stripped
        for part in location[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(location[-1], None)
    return stripped


def _suggestion(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    owner: type[BaseModel] | None = model
    for part in loc[:-1]:
        field = owner.model_fields.get(str(part)) if owner else None
        annotation = field.annotation if field else None
        owner = _model_in(annotation)
    if owner is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(owner.model_fields)}"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"Override {override!r} must look like key=value (e.g. rollout.temperature=0.7).")
    node = raw
    *parents, leaf = key.strip().split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"Override {override!r}: '{part}' is not a section.")
        node = child
    node[leaf] = yaml.safe_load(value)
