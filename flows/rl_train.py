"""The RL loop as Prefect flows: ``rl_train`` attaches to the run's workers, restores a checkpoint when
resuming, and runs one ``rl_step`` flow run per training step, in the order of XTuner's colocated
trainer. No math here.

Two changes of order from the reference:
- the checkpoint's files are written where the reference saves (after ``fit``), but it is sealed
  after ``log_step``, so that a complete checkpoint always means its step's trajectories, metrics
  and evaluation are recorded too;
- the next step's rollout is launched (``start_rollout``) once the step's weights are synced and
  evaluated, before its records are written: the Prefect API calls that end one step flow run and
  start the next then overlap generation instead of leaving the workers idle.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from engine.config import TrellisConfig
from engine.resume import meter_from, record_owner, started_by
from engine.secrets import install_log_redaction
from tasks.log_step import close_trackers, log_evaluation, log_step, open_trackers
from tasks.step_tasks import (
    attach_workers,
    commit_checkpoint,
    evaluate,
    export_hf,
    fit,
    forget_launched_rollouts,
    load_batch,
    prepare_data,
    produce_batch,
    release_workers,
    restore_checkpoint,
    save_checkpoint,
    start_rollout,
    sync_weights,
    write_trajectories,
)


@contextmanager
def phase(name: str, timings: dict[str, float]) -> Iterator[None]:
    started = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - started


@flow(name="rl_step", flow_run_name="rl_step[step={step}]", persist_result=False)
def rl_step(
    config: TrellisConfig, step: int, clock: dict[str, float], total_steps: int
) -> tuple[dict[str, float], dict[str, float]]:
    timings: dict[str, float] = {"fit": 0.0}
    started_s = time.time()
    links: dict[str, str] = {}
    with phase("produce_batch", timings):
        batch = load_batch(config, step) if config.debug_train else produce_batch(config, step)
    started_s = min(started_s, batch.launched_s)  # the step began with its rollout, perhaps in the previous flow run
    trajectories = None if config.debug_train else write_trajectories.submit(config, step, batch)  # beside prepare and fit
    with phase("prepare_data", timings):
        prepared = prepare_data(config, step, batch)
    fit_metrics: dict[str, float] = {}
    if not config.debug_rollout:
        with phase("fit", timings):
            fit_metrics = fit(config, step, prepared)
    checkpoint_due = config.checkpoint_due(step, total_steps)
    if checkpoint_due:
        with phase("save_checkpoint", timings):
            save_checkpoint(config, step)
    if config.hf_due(step, total_steps):
        with phase("save_hf", timings):
            links["hf"] = export_hf(config, step)
    synced = step % config.sync_weights_interval == 0 and not (config.debug_rollout or config.debug_train)
    if synced:
        with phase("sync_weights", timings):
            sync_weights(config, step)
    eval_metrics: dict[str, float] = {}
    if trajectories is not None:
        links["trajectories"] = trajectories.result()
    if synced and config.enable_evaluate and step % config.evaluate_step == 0:
        with phase("evaluate", timings):
            links["eval-trajectories"], eval_metrics = evaluate(config, step)
    timings["step"] = time.time() - started_s
    if config.cluster.overlap_next_rollout and step < total_steps and not config.debug_train:
        start_rollout(config, step + 1)
    metrics, clock = log_step(
        config,
        step,
        timings=timings,
        produce=batch.summary,
        data_info=prepared.info,
        fit_metrics=fit_metrics,
        eval_metrics=eval_metrics,
        clock=clock,
        links=links,
    )
    if checkpoint_due:  # sealed last: a complete checkpoint promises its step is fully recorded
        commit_checkpoint(config, step, clock)
    return metrics, clock


@flow(
    name="rl_train",
    flow_run_name="rl_train[{config.experiment_name}]",
    persist_result=False,
    retries=1,
    retry_delay_seconds=2,
)
def rl_train(config: TrellisConfig, resume: bool = False) -> dict[str, float]:
    """Train to ``total_train_steps``. With ``resume`` (or ``auto_resume``, or on a flow retry) the run
    continues from its latest complete checkpoint; otherwise a re-run continues live workers."""
    install_log_redaction(config.storage_options)
    logger = get_run_logger()
    # A retry resumes only if this flow run got past its start decision before failing.
    resume = resume or (flow_run.get_run_count() > 1 and started_by(config, str(flow_run.get_id())))
    workers = attach_workers(config)
    logger.info("Workers on %s; train prompts: %s", workers["address"], workers["train_report"])
    overlap = config.cluster.overlaps_next_rollout(bool(workers["rollout_on_gpu"]))  # the steps see the decision
    config = config.model_copy(update={"cluster": config.cluster.model_copy(update={"overlap_next_rollout": overlap})})
    start = restore_checkpoint(config, resume, workers)
    record_owner(config, str(flow_run.get_id()))
    if start["action"] != "fresh":
        logger.info("Start: %s at step %d %s", start["action"], start["step"], start["checkpoint"] or "")
    first, last = int(start["step"]) + 1, int(workers["total_train_steps"])
    if first > last:
        logger.info("The run is already at step %d of %d: nothing to train.", first - 1, last)
    open_trackers(config, first)
    trains_and_rolls = not (config.debug_rollout or config.debug_train)
    if config.enable_initial_evaluate and first == 1 and trains_and_rolls:
        link, metrics = evaluate(config, 0)
        log_evaluation(config, 0, metrics, link)
    clock = meter_from(start["train_state"]).clock()
    metrics: dict[str, float] = {}
    forget_launched_rollouts(config)
    # Step flow runs send no heartbeats: this run's own heartbeat covers them, and each one's heartbeat
    # thread is joined at the step's end, up to a second per step.
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        for step in range(first, last + 1):
            metrics, clock = rl_step(config, step, clock, last)
    close_trackers(config)
    if config.cluster.release_workers_at_end:
        release_workers(config)
    return metrics

