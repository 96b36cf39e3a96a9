"""The ``log_step`` task: assemble a step's metrics, write them to the trackers, publish artifacts."""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Callable

from prefect import task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from engine.config import TrellisConfig
from engine.metrics import JsonlTracker, TensorboardTracker, ThroughputMeter, Tracker, assemble_step_metrics
from tasks.artifacts import artifact_key


_trackers: dict[str, list[Tracker]] = {}
_publishing: list[threading.Thread] = []
logger = logging.getLogger(__name__)


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
    wait_for_artifacts()
    for tracker in _trackers.pop(f"{config.run_uri}/logs", []):
        tracker.close()


def publish_beside_next_step(publish: Callable[[], None]) -> None:
    """Run ``publish`` (Prefect artifact calls, one API request each) in a thread, in the calling
    task's run context, so the next step need not wait for it. One step's artifacts at a time."""
    wait_for_artifacts()
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(_logged_failure, publish), name="trellis-artifacts", daemon=True)
    thread.start()
    _publishing.append(thread)


def wait_for_artifacts() -> None:
    while _publishing:
        _publishing.pop().join()


def _logged_failure(publish: Callable[[], None]) -> None:
    try:
        publish()
    except Exception:  # the metrics are already in the trackers; a lost artifact must not end the run
        logger.warning("Could not publish the step's Prefect artifacts", exc_info=True)


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
    """Write the step's metrics to the trackers, then publish them as Prefect artifacts beside the
    next step; return them and the run clock."""
    meter = ThroughputMeter.from_clock(clock)
    metrics = assemble_step_metrics(
        timings=timings, produce=produce, data_info=data_info, fit_metrics=fit_metrics, eval_metrics=eval_metrics, meter=meter
    )
    for tracker in trackers(config):
        tracker.log(metrics, step)

    def publish() -> None:
        create_table_artifact(
            key=artifact_key(config, "step-metrics"),
            table=[{"metric": k, "value": round(v, 6)} for k, v in sorted(metrics.items())],
            description=f"{config.experiment_name}: metrics of step {step}",
        )
        for name, uri in links.items():
            create_link_artifact(key=artifact_key(config, name), link=uri, link_text=f"{name} of step {step}")

    publish_beside_next_step(publish)
    return metrics, meter.clock()


@task(name="log_evaluation", task_run_name="log_evaluation[step={step}]", cache_policy=NO_CACHE, persist_result=False)
def log_evaluation(config: TrellisConfig, step: int, eval_metrics: dict[str, float], link: str) -> dict[str, float]:
    """The initial evaluation (step 0), before any training."""
    metrics = {f"eval/{k}": v for k, v in eval_metrics.items()}
    for tracker in trackers(config):
        tracker.log(metrics, step)
    create_link_artifact(key=artifact_key(config, "eval-trajectories"), link=link, link_text=f"eval trajectories of step {step}")
    return metrics
