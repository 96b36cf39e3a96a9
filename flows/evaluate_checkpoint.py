"""Evaluate a run's checkpoint (its latest complete one, or the one given) on its eval set: eval rows
into the lake, pass@k by data source as an artifact, the evaluation into the run's lineage. A
schedule on its deployment evaluates whatever the run saved last."""

from __future__ import annotations

from prefect import flow

from trellis.engine.config import TrellisConfig
from trellis.tasks.offline_tasks import evaluate_checkpoint_task


@flow(name="evaluate_checkpoint", flow_run_name="evaluate_checkpoint[{config.experiment_name}]", persist_result=False)
def evaluate_checkpoint(
    config: TrellisConfig, checkpoint: str | None = None, samples_per_prompt: int | None = None, temperature: float | None = None
) -> dict[str, float]:
    """``checkpoint``: a step number of the run, a checkpoint or HF folder URI, or empty for the latest.
    ``samples_per_prompt`` (k of pass@k) and ``temperature`` replace the config's eval settings."""
    return evaluate_checkpoint_task(config, checkpoint, samples_per_prompt, temperature)
