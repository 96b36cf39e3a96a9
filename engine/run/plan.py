"""What a run does, decided once: the run plan (resolved when the workers are up) and, from it, the
plan of each step (which phases are due). Both runners, the Prefect flow on Ray and the in-process
one, take every decision from here, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from trellis.engine.config import ResourcesConfig, TrellisConfig
from trellis.engine.run.metrics import RunCounters, RunDevices, SideDevices
from trellis.engine.run.resume import StartPlan
from trellis.engine.secrets import redact_settings
from trellis.engine.storage.checkpoints import write_json
from trellis.engine.storage.store import Store
from trellis.engine.storage.lake import LakeError, stored_steps

Role = Literal["controller", "trainer", "rollout"]
ROLES: tuple[Role, ...] = ("controller", "trainer", "rollout")


def roles_for(config: TrellisConfig) -> tuple[Role, ...]:
    """The workers a run needs: debug_rollout starts no trainer, debug_train no rollout worker."""
    if config.debug_rollout:
        return ("controller", "rollout")
    if config.debug_train:
        return ("controller", "trainer")
    return ROLES


def resolve_total_steps(config: TrellisConfig, dataset_size: int) -> int:
    """``total_train_steps``, or the steps ``total_epochs`` make of the dataset, or (``debug_train``
    without either) one step per stored batch."""
    if config.total_train_steps is not None:
        return config.total_train_steps
    if config.debug_train:
        assert config.debug_rollout_dir is not None  # the config requires it in debug_train
        steps = stored_steps(Store(config.debug_rollout_dir, config.storage_options), "train")
        if not steps:
            raise LakeError(
                f"debug_train found no stored batches under {config.debug_rollout_dir}/trajectories/split=train; "
                "point debug_rollout_dir at a run folder (or a debug_rollout output)."
            )
        return max(steps)
    assert config.total_epochs is not None  # the config validator guarantees one of the two
    return max(1, dataset_size // config.train_batch_size * config.total_epochs)


@dataclass(frozen=True)
class WorkerFacts:
    """What a run's workers report once they are up, in either runner."""

    dataset_size: int  # usable training prompts
    pad_token_id: int
    train_report: str  # rows read, used and skipped, by reason
    applied_step: int  # the trainer's last applied step (0: none, or no trainer)
    holds_state: bool  # a live worker already trained, synced weights or drew prompts
    rollout_on_gpu: bool
    train_on_gpu: bool


class RunPlan(BaseModel):
    """Everything derived about a run, resolved once before its first step; frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    total_steps: int
    pad_token_id: int
    roles: tuple[Role, ...]
    rollout_on_gpu: bool
    overlap_next_rollout: bool  # launch each step's rollout at the end of the previous step
    check_rollout_every: int = 0  # the rollout health check before every N-th weight sync (0: never)
    start: StartPlan
    counters: RunCounters  # the throughput counters the first step continues
    devices: RunDevices  # what the per-device throughput/* of each side divide by
    initial_evaluation: bool
    keeps_records: bool = True  # False: trajectories, metrics and checkpoints are not written (benchmarks)
    train_report: str = ""

    @property
    def first_step(self) -> int:
        return self.start.step + 1

    @property
    def trains_and_rolls(self) -> bool:
        return "trainer" in self.roles and "rollout" in self.roles


def resolve_run_plan(
    config: TrellisConfig,
    facts: WorkerFacts,
    start: StartPlan,
    counters: RunCounters,
    *,
    keeps_records: bool = True,
) -> RunPlan:
    roles = roles_for(config)
    both = "trainer" in roles and "rollout" in roles
    return RunPlan(
        total_steps=resolve_total_steps(config, facts.dataset_size),
        pad_token_id=facts.pad_token_id,
        roles=roles,
        rollout_on_gpu=facts.rollout_on_gpu,
        overlap_next_rollout=config.cluster.overlaps_next_rollout(facts.rollout_on_gpu)
        and not (config.debug_train or config.disaggregated),
        check_rollout_every=config.rollout.health_check.every(facts.rollout_on_gpu),
        start=start,
        counters=counters,
        devices=run_devices(config, facts),
        initial_evaluation=config.enable_initial_evaluate and start.step == 0 and both,
        keeps_records=keeps_records,
        train_report=facts.train_report,
    )


def run_devices(config: TrellisConfig, facts: WorkerFacts) -> RunDevices:
    """Each side's workers and the devices each holds: ``accelerators_per_worker`` GPUs on a GPU (1 for
    a colocated worker, which shares its GPU), one process on CPU (where ``accelerators_per_worker``
    counts cores, not devices)."""

    def side(resources: ResourcesConfig, on_gpu: bool) -> SideDevices:
        per_worker = resources.accelerators_per_worker if on_gpu else 1.0
        return SideDevices(workers=resources.num_workers, devices_per_worker=per_worker)

    return RunDevices(
        train=side(config.train_resources, facts.train_on_gpu),
        rollout=side(config.rollout_resources, facts.rollout_on_gpu),
    )


@dataclass(frozen=True)
class StepPlan:
    """Which phases one step runs; ``engine.run.step.run_step`` runs them in their order."""

    step: int
    batch_source: Literal["produce_batch", "load_batch", "get_batch"]  # load_batch: debug_train replays a
    # stored batch; get_batch: the disaggregated trainer takes one from the replay buffer
    write_trajectories: bool
    fit: bool
    save_checkpoint: bool
    export_hf: bool
    sync_weights: bool
    check_weights: bool  # after sync_weights: the rollout serves the trainer's weights
    check_rollout: bool  # before sync_weights: the rollout engines' health check
    evaluate: bool
    launch_next_rollout: bool  # start_rollout[step + 1] before this step's records
    check_stability: bool = False  # after fit: the stability guard's rules; a trip rolls back (engine.run.rollback)
    disaggregated: bool = False  # the producer runs beside the step; it pauses around a weight sync


def plan_step(config: TrellisConfig, plan: RunPlan, step: int) -> StepPlan:
    """Every due-decision of a step. Saves and evaluations fall on weight-sync steps (the config's
    interval rules make sure of it); a debug mode leaves out the side it does not start."""
    trains, rolls = "trainer" in plan.roles, "rollout" in plan.roles
    records = plan.keeps_records
    last = step == plan.total_steps
    # The producer goes on with the last weights after the run's end too (resume, evaluation): sync them.
    synced = trains and rolls and (step % config.sync_weights_interval == 0 or (config.disaggregated and last))
    source = "get_batch" if config.disaggregated else ("produce_batch" if rolls else "load_batch")
    return StepPlan(
        step=step,
        batch_source=source,
        write_trajectories=records and rolls,
        fit=trains,
        save_checkpoint=records and trains and _checkpoint_due(config, step, last),
        export_hf=records and trains and config.hf_interval not in (None, -1) and (step % config.hf_interval == 0 or last),
        sync_weights=synced,
        check_weights=synced and _every(config.check_weights_interval, step // config.sync_weights_interval),
        check_rollout=synced and _every(plan.check_rollout_every, step // config.sync_weights_interval),
        evaluate=synced and config.enable_evaluate and step % config.evaluate_step == 0,
        launch_next_rollout=plan.overlap_next_rollout and rolls and not last and not config.disaggregated,
        check_stability=config.guard.enabled and trains,
        disaggregated=config.disaggregated,
    )


def _every(interval: int, count: int) -> bool:
    """The ``count``-th occurrence is due every ``interval`` (0: never)."""
    return interval > 0 and count % interval == 0


def _checkpoint_due(config: TrellisConfig, step: int, last: bool) -> bool:
    """On the interval, and at the last step when it syncs weights (the run can then be extended)."""
    if config.checkpoint_interval in (None, -1):
        return False
    return step % config.checkpoint_interval == 0 or (last and step % config.sync_weights_interval == 0)


def run_config_uri(run_uri: str) -> str:
    return f"{run_uri.rstrip('/')}/logs/config.json"


def record_run_config(config: TrellisConfig) -> str:
    """Write the run's settings beside its logs (``logs/config.json``), as it was launched with them, for
    ``trellis replay`` and for people. Without ``storage_options``, with URL passwords and the
    secret-named entries of free-form mappings masked: whoever reads the run brings their own credentials."""
    uri = run_config_uri(config.run_uri)
    write_json(redact_settings(config, exclude={"storage_options"}), Store(uri, config.storage_options))
    return uri


def run_plan_uri(config: TrellisConfig) -> str:
    return f"{config.run_uri}/logs/run_plan.json"


def record_run_plan(config: TrellisConfig, plan: RunPlan) -> str:
    """Write the plan beside the run's logs (``logs/run_plan.json``): what the run resolved at its start,
    for people and for the CLI's progress bar."""
    uri = run_plan_uri(config)
    write_json(plan.model_dump(mode="json"), Store(uri, config.storage_options))
    return uri
