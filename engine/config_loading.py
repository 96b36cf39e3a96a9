"""Load a ``TrellisConfig`` from YAML and ``key=value`` overrides, with errors a person can act on."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from engine.config import TrellisConfig


class ConfigError(ValueError):
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
    for override in overrides or []:
        _apply_override(raw, override)
    raw.update(fields)
    return parse_config(raw)


def parse_config(raw: dict[str, Any]) -> TrellisConfig:
    try:
        return TrellisConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, TrellisConfig)) from None


# Keys that an earlier trellis accepted, and what replaced them.
RENAMED = {
    "train_worker.share_prompt_prefix": "train_worker.layout (shared_prefix for true, padded for false)",
}


def describe_validation_error(error: ValidationError, model: type[BaseModel]) -> str:
    lines = [f"Invalid configuration ({error.error_count()} problem(s)):"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden" and location in RENAMED:
            lines.append(f"  - {location}: renamed; use {RENAMED[location]}")
        elif item["type"] == "extra_forbidden":
            lines.append(f"  - {location}: unknown key{_suggestion(model, item['loc'])}")
        elif item["type"] == "missing":
            lines.append(f"  - {location}: required, but not set")
        else:
            message = item["msg"].removeprefix("Value error, ")
            lines.append(f"  - {location or 'config'}: {message}")
    return "\n".join(lines)


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
