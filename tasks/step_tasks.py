"""One Prefect task per node of the step DAG; each forwards to the run's Ray actors.

Task options follow side effects: reads and idempotent writes retry (produce_batch draws the same
prompts on a retry; a trajectory part is replaced, not appended), while ``fit`` never retries and
refuses a step its worker has already applied. Batches stay in Ray's object store: a task returns
an ``ObjectRef`` and a few numbers, never tensors, to Prefect.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import ray
from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from engine import actors, weight_sync
from engine.checkpoint import require_complete, step_name
from engine.cluster import connect
from engine.config import TrellisConfig
from engine.metrics import ThroughputMeter
from engine.resume import begin_checkpoint, begin_hf_export, plan_start, seal_checkpoint, seal_hf_export, train_state
from engine.secrets import write_runtime_environment
from tasks.artifacts import artifact_key

_NOT_STORED = dict(cache_policy=NO_CACHE, persist_result=False)


@dataclass
class BatchRef:
    """A produced batch: small numbers for Prefect, the samples in Ray's object store, and the wall
    time its rollout was launched (before its step's flow run when ``start_rollout`` launched it)."""

    summary: dict[str, float]
    produced: ray.ObjectRef
    launched_s: float = math.inf


@dataclass
class PreparedRef:
    info: dict[str, float]
    prepared: ray.ObjectRef


def _wait(config: TrellisConfig, ref):
    return ray.get(ref, timeout=config.cluster.ray_get_timeout_s)


def _replace_lost_rollout_on_retry(config: TrellisConfig) -> None:
    """On a retry a lost rollout worker is the likely cause: replace it before trying again."""
    if task_run.run_count > 1 and not actors.rollout_alive(config):
        actors.restart_rollout(config)


@task(name="attach_workers", retries=2, retry_delay_seconds=2, **_NOT_STORED)
def attach_workers(config: TrellisConfig) -> dict[str, int | str]:
    """Connect to the cluster and get (or create) the run's named actors; report where they stand."""
    address = connect(config.cluster)
    write_runtime_environment(config.run_uri, config.storage_options)
    workers = actors.attach_workers(config)
    applied = _wait(config, workers.trainer.applied_step.remote()) if workers.trainer is not None else 0
    report = _wait(config, workers.controller.train_report.remote())
    rollout_gpu = _wait(config, workers.rollout.gpu_identity.remote()) if workers.rollout is not None else None
    return {
        "address": address,
        "total_train_steps": workers.total_train_steps,
        "applied_step": applied,
        "used": actors.workers_used(config, workers),
        "train_report": report,
        "rollout_on_gpu": rollout_gpu is not None,
    }


@task(name="restore_checkpoint", retries=1, retry_delay_seconds=2, **_NOT_STORED)
def restore_checkpoint(config: TrellisConfig, resume: bool, workers: dict) -> dict:
    """Decide where the run starts and bring the workers there (see ``engine.resume.plan_start``).
    Returns the plan and the checkpoint's train state (None when nothing was restored)."""
    plan = plan_start(config, resume=resume, applied_step=int(workers["applied_step"]), workers_used=bool(workers["used"]))
    state = None
    if plan.action == "restart":
        actors.release_workers(config)
        actors.attach_workers(config)
    elif plan.checkpoint is not None:
        state = require_complete(plan.checkpoint, config.storage_options)
        actors.restore_checkpoint(config, plan.checkpoint, reattach=plan.action == "reattach")
    return {"action": plan.action, "step": plan.step, "checkpoint": plan.checkpoint, "train_state": state}


# Rollouts launched ahead by ``start_rollout``, by (run, step): (launch wall time, summary, samples).
_launched: dict[tuple[str, int], tuple[float, ray.ObjectRef, ray.ObjectRef]] = {}


def _launch_rollout(config: TrellisConfig, step: int) -> tuple[float, ray.ObjectRef, ray.ObjectRef]:
    actors.hand_accelerator_to(config, "rollout")
    controller, rollout = actors.lookup(config, "controller"), actors.lookup(config, "rollout")
    launched_s = time.time()
    summary_ref, produced_ref = controller.produce_batch.remote(step, rollout)
    return launched_s, summary_ref, produced_ref


def forget_launched_rollouts(config: TrellisConfig) -> None:
    """A new attempt at a run starts afresh: a rollout launched by a failed attempt may predate a restore."""
    for key in [key for key in _launched if key[0] == config.run_uri]:
        del _launched[key]


@task(name="start_rollout", task_run_name="start_rollout[step={step}]", retries=2, retry_delay_seconds=1, **_NOT_STORED)
def start_rollout(config: TrellisConfig, step: int) -> None:
    """Launch ``step``'s rollout and return without waiting: the previous step's records and the next
    flow run's start then overlap generation. Same prompts and weights as a rollout launched by
    ``produce_batch[step]``, which collects it."""
    _replace_lost_rollout_on_retry(config)
    _launched[(config.run_uri, step)] = _launch_rollout(config, step)


@task(name="produce_batch", task_run_name="produce_batch[step={step}]", retries=2, retry_delay_seconds=1, **_NOT_STORED)
def produce_batch(config: TrellisConfig, step: int) -> BatchRef:
    launched = _launched.pop((config.run_uri, step), None)
    if launched is None:  # not launched ahead, or this is a retry after the launched one failed
        _replace_lost_rollout_on_retry(config)
        launched = _launch_rollout(config, step)
    launched_s, summary_ref, produced_ref = launched
    return BatchRef(_wait(config, summary_ref), produced_ref, launched_s)


@task(name="load_batch", task_run_name="load_batch[step={step}]", retries=2, retry_delay_seconds=1, **_NOT_STORED)
def load_batch(config: TrellisConfig, step: int) -> BatchRef:
    """debug_train: a stored batch from the Parquet lake instead of a rollout."""
    summary_ref, produced_ref = actors.lookup(config, "controller").load_batch.remote(step)
    return BatchRef(_wait(config, summary_ref), produced_ref)


@task(name="write_trajectories", task_run_name="write_trajectories[step={step}]", retries=2, retry_delay_seconds=1, **_NOT_STORED)
def write_trajectories(config: TrellisConfig, step: int, batch: BatchRef) -> str:
    controller = actors.lookup(config, "controller")
    return _wait(config, controller.write_trajectories.remote(batch.produced, step, "train"))


@task(name="prepare_data", task_run_name="prepare_data[step={step}]", retries=2, retry_delay_seconds=1, **_NOT_STORED)
def prepare_data(config: TrellisConfig, step: int, batch: BatchRef) -> PreparedRef:
    info_ref, prepared_ref = actors.lookup(config, "controller").prepare_data.remote(batch.produced, step)
    return PreparedRef(_wait(config, info_ref), prepared_ref)


@task(name="fit", task_run_name="fit[step={step}]", retries=0, **_NOT_STORED)
def fit(config: TrellisConfig, step: int, prepared: PreparedRef) -> dict[str, float]:
    """Not retried: an update is not idempotent, and the worker refuses a step it already applied."""
    actors.hand_accelerator_to(config, "trainer")
    result = _wait(config, actors.lookup(config, "trainer").fit.remote(prepared.prepared, step))
    return result.metrics


@task(name="save_checkpoint", task_run_name="save_checkpoint[step={step}]", retries=1, retry_delay_seconds=1, **_NOT_STORED)
def save_checkpoint(config: TrellisConfig, step: int) -> str:
    """Every worker writes its part of the checkpoint in parallel; ``commit_checkpoint`` seals it once
    the step is fully recorded. A retry starts the folder afresh."""
    uri = begin_checkpoint(config, step)
    waits = [actors.lookup(config, "controller").save_checkpoint.remote(uri)]
    if "trainer" in actors.roles(config):
        save_optimizer = not config.checkpoint_no_save_optimizer
        waits.append(actors.lookup(config, "trainer").save_checkpoint.remote(uri, config.storage_options, save_optimizer))
    _wait(config, waits)
    return uri


@task(name="commit_checkpoint", task_run_name="commit_checkpoint[step={step}]", retries=2, retry_delay_seconds=1, **_NOT_STORED)
def commit_checkpoint(config: TrellisConfig, step: int, clock: dict[str, float]) -> str:
    meter = ThroughputMeter.from_clock(clock)
    pruned = seal_checkpoint(config, step, train_state(step, meter, policy_version=step))
    if pruned:
        get_run_logger().info("Pruned checkpoints of steps %s", pruned)
    uri = f"{config.checkpoint_uri}/{step_name(step)}"
    create_link_artifact(key=artifact_key(config, "checkpoint"), link=uri, link_text=f"checkpoint of step {step}")
    return uri


@task(name="export_hf", task_run_name="export_hf[step={step}]", retries=1, retry_delay_seconds=1, **_NOT_STORED)
def export_hf(config: TrellisConfig, step: int) -> str:
    """``save_pretrained`` model + tokenizer under ``{run}/hf/step-NNNNNN``, pruned to ``hf_max_keep``."""
    uri = begin_hf_export(config, step)
    trainer = actors.lookup(config, "trainer")
    _wait(config, trainer.export_hf.remote(uri, config.storage_options, config.tokenizer_source))
    seal_hf_export(config, step)
    create_link_artifact(key=artifact_key(config, "hf-export"), link=uri, link_text=f"HF export of step {step}")
    return uri


@task(name="sync_weights", task_run_name="sync_weights[step={step}]", retries=2, retry_delay_seconds=1, **_NOT_STORED)
def sync_weights(config: TrellisConfig, step: int) -> int:
    """Trainer weights reach the rollout worker with no disk round trip (CUDA IPC on a shared GPU, an
    NCCL broadcast between GPUs, else the object store: ``cluster.weight_sync``); the next rollout
    task wakes the rollout worker's KV cache."""
    _replace_lost_rollout_on_retry(config)
    transport = weight_sync.push_weights(config, actors.lookup(config, "trainer"), actors.lookup(config, "rollout"), step)
    get_run_logger().debug("Weights of step %d synced through %s", step, transport)
    return step


@task(name="evaluate", task_run_name="evaluate[step={step}]", retries=2, retry_delay_seconds=1, **_NOT_STORED)
def evaluate(config: TrellisConfig, step: int) -> tuple[str, dict[str, float]]:
    _replace_lost_rollout_on_retry(config)
    actors.hand_accelerator_to(config, "rollout")
    controller, rollout = actors.lookup(config, "controller"), actors.lookup(config, "rollout")
    return _wait(config, controller.evaluate.remote(step, rollout))


@task(name="release_workers", **_NOT_STORED)
def release_workers(config: TrellisConfig) -> None:
    actors.release_workers(config)
