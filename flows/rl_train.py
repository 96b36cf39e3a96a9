"""The RL loop as Prefect flows: ``rl_train`` attaches to the run's workers and runs one ``rl_step``
flow run per training step, in the order of XTuner's colocated trainer. No math here."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from prefect import flow, get_run_logger

from engine.config import TrellisConfig
from tasks.log_step import close_trackers, log_evaluation, log_step
from tasks.step_tasks import (
    attach_workers,
    evaluate,
    fit,
    prepare_data,
    produce_batch,
    release_workers,
    sync_weights,
    write_trajectories,
)


@contextmanager
def phase(name: str, timings: dict[str, float]) -> Iterator[None]:
    started = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - started


@flow(name="rl_step", flow_run_name="rl_step[step={step}]", persist_result=False)
def rl_step(config: TrellisConfig, step: int, clock: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    timings: dict[str, float] = {}
    started = time.perf_counter()
    with phase("produce_batch", timings):
        batch = produce_batch(config, step)
    trajectories = write_trajectories.submit(config, step, batch)  # runs beside prepare_data and fit
    with phase("prepare_data", timings):
        prepared = prepare_data(config, step, batch)
    with phase("fit", timings):
        fit_metrics = fit(config, step, prepared)
    synced = step % config.sync_weights_interval == 0
    if synced:
        with phase("sync_weights", timings):
            sync_weights(config, step)
    eval_metrics: dict[str, float] = {}
    links = {"trajectories": trajectories.result()}
    if synced and config.enable_evaluate and step % config.evaluate_step == 0:
        with phase("evaluate", timings):
            links["eval-trajectories"], eval_metrics = evaluate(config, step)
    timings["step"] = time.perf_counter() - started
    return log_step(
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


@flow(name="rl_train", flow_run_name="rl_train[{config.experiment_name}]", persist_result=False)
def rl_train(config: TrellisConfig) -> dict[str, float]:
    """Train from the workers' current step to ``total_train_steps``; a re-run resumes where they are."""
    logger = get_run_logger()
    workers = attach_workers(config)
    logger.info("Workers on %s; train prompts: %s", workers["address"], workers["train_report"])
    first, last = int(workers["applied_step"]) + 1, int(workers["total_train_steps"])
    if first > 1:
        logger.info("Re-attached to live workers at step %d", first - 1)
    if config.enable_initial_evaluate and first == 1:
        link, metrics = evaluate(config, 0)
        log_evaluation(config, 0, metrics, link)
    clock = {"started_s": time.time(), "samples": 0.0, "tokens": 0.0}
    metrics: dict[str, float] = {}
    for step in range(first, last + 1):
        metrics, clock = rl_step(config, step, clock)
    close_trackers(config)
    if config.cluster.release_workers_at_end:
        release_workers(config)
    return metrics
