"""One Prefect task per node of the step DAG; each is a thin call into the run's Ray actors
(``engine.cluster.phases``).

Task options follow side effects: reads and idempotent writes retry (produce_batch collects or redraws
the same prompts on a retry; a trajectory part is replaced, not appended), while ``fit`` never retries
and refuses a step its worker has already applied. A retry first replaces a lost rollout worker, the
likely cause. Batches stay in Ray's object store: a task hands Prefect an ``ObjectRef`` and a few
numbers, never tensors.
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_link_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from engine.cluster.phases import ClusterPhases
from engine.config import TrellisConfig
from engine.errors import SettingError
from engine.run.metrics import RunCounters
from engine.run.run_log import run_log_for
from engine.run.step import Batch, Evaluation, Prepared
from tasks.artifacts import artifact_key, storage_link

NOT_STORED = dict(cache_policy=NO_CACHE, persist_result=False)


def unless_a_setting_error(task, task_run, state) -> bool:
    """Retry a failed task unless a setting the user must change failed it: the retry would meet it again."""
    return not isinstance(state.result(raise_on_failure=False), SettingError)


RETRIED = dict(retries=2, retry_delay_seconds=1, retry_condition_fn=unless_a_setting_error, **NOT_STORED)


def _phases(config: TrellisConfig) -> ClusterPhases:
    phases = ClusterPhases(config)
    if task_run.run_count > 1:
        run_log_for(config).warning(f"{task_run.name}: retry {task_run.run_count - 1} after a failure; replacing lost rollout workers")
        phases.workers.replace_lost_rollout()
    return phases


@task(name="produce_batch", task_run_name="produce_batch[step={step}]", **RETRIED)
def produce_batch(config: TrellisConfig, step: int) -> Batch:
    return _phases(config).produce_batch(step)


@task(name="start_rollout", task_run_name="start_rollout[step={step}]", **RETRIED)
def start_rollout(config: TrellisConfig, step: int) -> None:
    """Launch ``step``'s rollout and return without waiting: the previous step's records and the next
    flow run's start then overlap generation. ``produce_batch[step]`` collects it."""
    _phases(config).start_rollout(step)


@task(name="load_batch", task_run_name="load_batch[step={step}]", **RETRIED)
def load_batch(config: TrellisConfig, step: int) -> Batch:
    return _phases(config).load_batch(step)


@task(name="write_trajectories", task_run_name="write_trajectories[step={step}]", **RETRIED)
def write_trajectories(config: TrellisConfig, step: int, batch: Batch) -> str:
    return _phases(config).write_trajectories(step, batch, flow_run_id=str(flow_run.get_id())).result()


@task(name="prepare_data", task_run_name="prepare_data[step={step}]", **RETRIED)
def prepare_data(config: TrellisConfig, step: int, batch: Batch) -> Prepared:
    return _phases(config).prepare_data(step, batch)


@task(name="fit", task_run_name="fit[step={step}]", retries=0, **NOT_STORED)
def fit(config: TrellisConfig, step: int, prepared: Prepared) -> dict[str, float]:
    """Not retried: an update is not idempotent, and the worker refuses a step it already applied."""
    return ClusterPhases(config).fit(step, prepared)


@task(name="save_checkpoint", task_run_name="save_checkpoint[step={step}]", retries=1, retry_delay_seconds=1, **NOT_STORED)
def save_checkpoint(config: TrellisConfig, step: int) -> str:
    """A retry starts the folder afresh; ``commit_checkpoint`` seals it once the step is recorded."""
    return ClusterPhases(config).save_checkpoint(step)


@task(name="export_hf", task_run_name="export_hf[step={step}]", retries=1, retry_delay_seconds=1, **NOT_STORED)
def export_hf(config: TrellisConfig, step: int) -> str:
    return ClusterPhases(config).export_hf(step)


@task(name="sync_weights", task_run_name="sync_weights[step={step}]", **RETRIED)
def sync_weights(config: TrellisConfig, step: int) -> None:
    """Trainer weights reach the rollout worker with no disk round trip (CUDA IPC on a shared GPU, an
    NCCL broadcast between GPUs, else the object store: ``cluster.weight_sync``)."""
    _phases(config).sync_weights(step)


@task(name="evaluate", task_run_name="evaluate[step={step}]", **RETRIED)
def evaluate(config: TrellisConfig, step: int) -> Evaluation:
    return _phases(config).evaluate(step, flow_run_id=str(flow_run.get_id()))


@task(name="commit_checkpoint", task_run_name="commit_checkpoint[step={step}]", **RETRIED)
def commit_checkpoint(config: TrellisConfig, step: int, counters: RunCounters) -> str:
    uri = ClusterPhases(config).commit_checkpoint(step, counters)
    create_link_artifact(key=artifact_key(config, "checkpoint"), link=storage_link(config, uri), link_text=f"checkpoint of step {step}: {uri}")
    return uri


@task(name="get_batch", task_run_name="get_batch[step={step}]", **RETRIED)
def get_batch(config: TrellisConfig, step: int) -> Batch:
    """disaggregated: the next batch from the replay buffer the producer fills beside the trainer. A
    retry (the producer failed: a lost rollout worker, say) replaces the worker and restarts it first."""
    phases = _phases(config)
    if task_run.run_count > 1:
        phases.restart_producer()
    return phases.get_batch(step)


@task(name="pause_produce", task_run_name="pause_produce[step={step}]", **RETRIED)
def pause_produce(config: TrellisConfig, step: int) -> float:
    return ClusterPhases(config).pause_produce(step)


@task(name="continue_produce", task_run_name="continue_produce[step={step}]", **RETRIED)
def continue_produce(config: TrellisConfig, step: int) -> None:
    """The producer goes on with the weights of ``step``; a lost rollout worker is replaced first."""
    _phases(config).continue_produce(step)
