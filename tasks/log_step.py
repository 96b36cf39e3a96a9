"""The ``log_step`` and ``log_evaluation`` tasks: a step's metrics to the run's trackers (kept by the
controller actor) and to Prefect artifacts."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_link_artifact, create_table_artifact

from engine.cluster.phases import ClusterPhases
from engine.config import TrellisConfig
from engine.run.metrics import RunDevices, StepRecord
from engine.run.step import Evaluation, Logged
from tasks.artifacts import artifact_key, storage_link
from tasks.step_tasks import RETRIED


@task(name="log_step", task_run_name="log_step[step={step}]", **RETRIED)
def log_step(config: TrellisConfig, step: int, record: StepRecord, devices: RunDevices) -> Logged:
    """Write the step's metrics to the trackers and Prefect artifacts; return them and the run counters.
    ``devices``: the run plan's, which the per-device ``throughput/*`` divide by."""
    logged = ClusterPhases(config).log_step(step, record, devices)
    create_table_artifact(
        key=artifact_key(config, "step-metrics"),
        table=[{"metric": k, "value": round(v, 6)} for k, v in sorted(logged.metrics.items())],
        description=f"{config.experiment_name}: metrics of step {step}",
    )
    for name, uri in record.links.items():
        create_link_artifact(key=artifact_key(config, name), link=storage_link(config, uri), link_text=f"{name} of step {step}: {uri}")
    return logged


@task(name="log_evaluation", task_run_name="log_evaluation[step={step}]", **RETRIED)
def log_evaluation(config: TrellisConfig, step: int, evaluation: Evaluation) -> dict[str, float]:
    """The initial evaluation (step 0), before any training."""
    metrics = ClusterPhases(config).log_evaluation(step, evaluation)
    link = artifact_key(config, "eval-trajectories")
    create_link_artifact(key=link, link=storage_link(config, evaluation.uri), link_text=f"eval trajectories of step {step}: {evaluation.uri}")
    return metrics
