"""The ``log_step`` task: assemble a step's metrics, write them to the trackers, publish artifacts."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from engine.config import TrellisConfig
from engine.metrics import JsonlTracker, TensorboardTracker, ThroughputMeter, Tracker, assemble_step_metrics
from tasks.artifacts import artifact_key


_trackers: dict[str, list[Tracker]] = {}


def open_trackers(config: TrellisConfig, first_step: int) -> None:
    """(Re)open the run's trackers before its first step; a resumed run drops what it will redo."""
    close_trackers(config)
    logs = f"{config.run_uri}/logs"
    chosen: list[Tracker] = [JsonlTracker(f"{logs}/metrics.jsonl", config.storage_options)]
    if config.exp_tracker == "tensorboard":
        chosen.append(TensorboardTracker(
            f"{logs}/tensorboard", purge_step=first_step if first_step > 1 else None, storage_options=config.storage_options
        ))
    _trackers[logs] = chosen


def trackers(config: TrellisConfig) -> list[Tracker]:
    """One set of trackers per run and process: TensorBoard writers must not be reopened every step."""
    logs = f"{config.run_uri}/logs"
    if logs not in _trackers:
        open_trackers(config, first_step=1)
    return _trackers[logs]


def close_trackers(config: TrellisConfig) -> None:
    for tracker in _trackers.pop(f"{config.run_uri}/logs", []):
        tracker.close()


@task(name="log_step", task_run_name="log_step[step={step}]", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE, persist_result=False)
def log_step(
    config: TrellisConfig,
    step: int,
    *,
    timings: dict[str, float],
    produce: dict[str, float],
    data_info: dict[str, float],
    fit_metrics: dict[str, float],
    eval_metrics: dict[str, float],
    clock: dict[str, float],
    links: dict[str, str],
) -> tuple[dict[str, float], dict[str, float]]:
    """Write the step's metrics to the trackers and Prefect artifacts; return them and the run clock."""
    meter = ThroughputMeter.from_clock(clock)
    metrics = assemble_step_metrics(
        timings=timings, produce=produce, data_info=data_info, fit_metrics=fit_metrics, eval_metrics=eval_metrics, meter=meter
    )
    for tracker in trackers(config):
        tracker.log(metrics, step)
    create_table_artifact(
        key=artifact_key(config, "step-metrics"),
        table=[{"metric": k, "value": round(v, 6)} for k, v in sorted(metrics.items())],
        description=f"{config.experiment_name}: metrics of step {step}",
    )
    for name, uri in links.items():
        create_link_artifact(key=artifact_key(config, name), link=uri, link_text=f"{name} of step {step}")
    return metrics, meter.clock()


@task(name="log_evaluation", task_run_name="log_evaluation[step={step}]", cache_policy=NO_CACHE, persist_result=False)
def log_evaluation(config: TrellisConfig, step: int, eval_metrics: dict[str, float], link: str) -> dict[str, float]:
    """The initial evaluation (step 0), before any training."""
    metrics = {f"eval/{k}": v for k, v in eval_metrics.items()}
    for tracker in trackers(config):
        tracker.log(metrics, step)
    create_link_artifact(key=artifact_key(config, "eval-trajectories"), link=link, link_text=f"eval trajectories of step {step}")
    return metrics
