"""What every config section shares: frozen, unknown keys refused, storage options that never
serialize their credentials."""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, PlainSerializer

from trellis.engine.secrets import REDACTED, looks_secret, redact_mapping


def _no_masked_secrets(options: dict[str, Any]) -> dict[str, Any]:
    masked = [name for name, value in options.items() if value == REDACTED]
    if masked:
        raise ValueError(
            f"storage_options {masked} hold the mask {REDACTED!r}, not credentials: configs written out by "
            "trellis (Prefect parameters, checkpoints) never carry secrets. Put the credentials in the "
            "workers' environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or in the YAML file."
        )
    return options


# JSON dumps of a config reach Prefect's API (flow parameters), checkpoints and logs: never credentials.
StorageOptions = Annotated[
    dict[str, Any], AfterValidator(_no_masked_secrets), PlainSerializer(redact_mapping, when_used="json")
]


def _absolute_if_local(location: str) -> str:
    """A local path relative to the directory the config is read in, made absolute: workers run in
    other directories (their own code folder) and on other nodes. URIs (``s3://...``) stay as they are."""
    if "://" in location:
        return location
    return os.path.abspath(os.path.expanduser(location))


# A file or folder: a local path (resolved when the config is read) or any fsspec URI.
Location = Annotated[str, AfterValidator(_absolute_if_local)]


def checked_runtime_env(runtime_env: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """A Ray runtime_env a user adds to the workers': no code (trellis ships it) and no secrets (Ray
    shows runtime_envs in its records and dashboard)."""
    if not runtime_env:
        return runtime_env
    managed = sorted(set(runtime_env) & {"working_dir", "py_modules", "excludes"})
    if managed:
        raise ValueError(f"{where} sets {managed}: trellis ships the run's code itself (cluster.code_dir, cluster.code_excludes).")
    secret = sorted(name for name in (runtime_env.get("env_vars") or {}) if looks_secret(name))
    if secret:
        raise ValueError(
            f"{where}.env_vars holds {secret}: Ray shows runtime_envs in its records and dashboard. Set them in the "
            "launching shell and list them in cluster.forward_env instead."
        )
    return runtime_env


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


