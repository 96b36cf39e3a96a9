"""``exp_tracker`` and the ``trackers:`` section: where a run's metrics go besides ``metrics.jsonl``
(``engine.storage.trackers``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator

from trellis.engine.config.base import Frozen

TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


def tracker_names(value: object) -> object:
    """``exp_tracker: tensorboard`` and ``exp_tracker: [tensorboard, mlflow]`` both read as a list."""
    return [value] if isinstance(value, str) else value


# One name or a list, read as a list. The JSON schema says both (Prefect checks a deployment's parameters
# against it, and configs written before the list was allowed hold one name).
TrackerNames = Annotated[list[TrackerName], BeforeValidator(tracker_names, json_schema_input_type=TrackerName | list[TrackerName])]


class WandbConfig(Frozen):
    """Weights & Biases (``pip install wandb``). Offline by default: the run is written under ``dir``
    and uploaded later with ``wandb sync DIR``; online needs ``WANDB_API_KEY`` in the environment (it is
    masked like every secret, never written by trellis)."""

    project: str = Field("trellis", min_length=1, description="The W&B project the run goes to.")
    entity: str | None = Field(None, description="The W&B team or user; null: the API key's default.")
    mode: Literal["offline", "online"] = Field("offline", description="offline: files only, synced later; online: live.")
    dir: str | None = Field(
        None, description="Local folder for W&B's files; null: the run's logs/ folder when it is local, else ./wandb.",
    )
    tags: list[str] = Field(default_factory=list, description="Tags on the W&B run.")


class MlflowConfig(Frozen):
    """MLflow (``pip install mlflow``): the run is an MLflow run of ``experiment`` on ``tracking_uri``,
    its metrics logged by step, its settings as params. A resumed trellis run goes on in the same MLflow
    run (found by its ``trellis.run_uri`` tag)."""

    tracking_uri: str | None = Field(
        None, description="The tracking server (http://host:5000) or store (file:./mlruns); null: MLFLOW_TRACKING_URI.",
    )
    experiment: str = Field("trellis", min_length=1, description="The MLflow experiment the run goes to (made if missing).")
    log_params: bool = Field(True, description="Log the run's settings (secrets masked) as the MLflow run's params.")


class TrackersConfig(Frozen):
    """The settings of the trackers ``exp_tracker`` names."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)

    @field_validator("wandb", "mlflow", mode="before")
    @classmethod
    def _empty_is_default(cls, value: object) -> object:
        return {} if value is None else value
