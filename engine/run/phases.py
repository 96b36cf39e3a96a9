"""Every phase of a step, written once: its body over the ``Workers`` interface, and one row of the table
at the bottom saying who it drives, how it retries, what a retry does first and what it publishes.

Both runners run these rows: the in-process runner calls ``run_phase`` (``LocalWorkers``), the Prefect
flow runs one task per row (``tasks.phases``: the task's name, retries and artifacts come from the row)
whose body calls ``run_phase`` over Ray actors (``engine.cluster.ray_workers.RayWorkers``). Adding a
phase is a body and a row here, its place in the step (``engine.run.step``) and, when it is due only
sometimes, its due-decision (``engine.run.plan``).

The functions named ``_..._on`` run on a worker, as ``fn(worker, *args)``; on a cluster they travel to
the actor by reference (module and name), so they stay module-level.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

from trellis.engine.faults import fault_point
from trellis.engine.rollout.production.controller import Controller
from trellis.engine.rollout.production.produce import ProduceResult, produce_summary
from trellis.engine.run.metrics import RunCounters, StepRecord, assemble_step_metrics
from trellis.engine.run.context import PhaseContext
from trellis.engine.run.plan import Role
from trellis.engine.run.results import BatchHandle, Evaluation, Logged, Prepared
from trellis.engine.run.rollback import check_stability, roll_back
from trellis.engine.run.resume import begin_checkpoint, begin_hf_export, seal_checkpoint, seal_hf_export, train_state
from trellis.engine.run.run_log import record_step
from trellis.engine.run.tracing import sample_spans
from trellis.engine.run.workers import Call, each
from trellis.engine.storage.checkpoints import step_name
from trellis.engine.storage.store import Store
from trellis.engine.train.worker import TrainingWorker
from trellis.engine.weights.fingerprint import fingerprint, largest_difference

_POLL_S = 2.0  # how long one ask of the replay buffer holds the controller


# -- where a batch comes from -------------------------------------------------------------------------


def _kept_on(controller: Controller, step: int, produced: ProduceResult, expired: bool = False) -> BatchHandle:
    controller.keep(step, produced)
    trace = controller.config.trace
    spans = sample_spans(produced.groups) if trace.enabled and trace.samples else ()
    return BatchHandle(step, produced=produced.produced_samples, expired=expired, launched_s=produced.launched_s,
                       metrics=produce_summary(produced), sample_spans=spans)


def _produce_on(controller: Controller, engines: Any, step: int) -> BatchHandle:
    return _kept_on(controller, step, controller.produce_batch(step, engines))


def produce_batch(ctx: PhaseContext, step: int) -> BatchHandle:
    """Collects the batch ``start_rollout`` launched ahead, or produces it now."""
    return ctx.workers.drive(_produce_on, step)


def start_rollout(ctx: PhaseContext, step: int) -> None:
    """Launch ``step``'s rollout and return without waiting: the previous step's records (and, in the flow,
    the next flow run's start) overlap generation. ``produce_batch[step]`` collects it."""
    ctx.workers.drive(_produce_on, step, wait=False)


def _load_on(controller: Controller, step: int) -> BatchHandle:
    return _kept_on(controller, step, controller.load_batch(step))


def load_batch(ctx: PhaseContext, step: int) -> BatchHandle:
    """debug_train: a stored batch from the Parquet lake instead of a rollout."""
    return each(ctx.workers, "controller", _load_on, step)[0]


def _take_on(controller: Controller, step: int, wait_s: float) -> BatchHandle:
    taken = controller.producer.get_batch(step, wait_s)
    if taken is None:
        return BatchHandle(step, ready=False)
    return _kept_on(controller, step, taken.as_produced(), expired=taken.expired)


def get_batch(ctx: PhaseContext, step: int) -> BatchHandle:
    """disaggregated: the next batch from the producer's replay buffer, asked for every few seconds (each
    ask holds the controller that long) until ``cluster.ray_get_timeout_s``."""
    timeout_s = ctx.config.cluster.ray_get_timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        batch = each(ctx.workers, "controller", _take_on, step, _POLL_S)[0]
        if batch.ready:
            return batch
        if time.monotonic() > deadline:
            raise TimeoutError(f"No batch for step {step} within {timeout_s:g}s.")


def _pause_on(controller: Controller, timeout_s: float) -> float:
    paused_s = controller.producer.pause_produce(timeout_s)
    fault_point("controller.paused")
    return paused_s


def pause_produce(ctx: PhaseContext, step: int) -> float:
    return each(ctx.workers, "controller", _pause_on, ctx.config.cluster.ray_get_timeout_s)[0]


def _continue_on(controller: Controller, engines: Any, model_step: int | None) -> None:
    """``model_step``: the weights the engines serve; None after a failure: whatever they serve now."""
    controller.producer.continue_produce(engines.policy_version if model_step is None else model_step, engines)


def continue_produce(ctx: PhaseContext, step: int) -> None:
    """The producer goes on with the weights of ``step``, which the rollout now serves."""
    ctx.workers.drive(_continue_on, step)


# -- the batch's way to the trainer -------------------------------------------------------------------


def _write_on(controller: Controller, step: int, origin: str | None) -> str:
    produced = controller.batch(step)
    return controller.write_trajectories(produced.groups, step, "train", origin, ledger=produced.ledger)[0]


def write_trajectories(ctx: PhaseContext, step: int) -> str:
    return each(ctx.workers, "controller", _write_on, step, ctx.origin)[0]


def _prepare_on(controller: Controller, step: int) -> tuple[dict[str, float], Any]:
    prepared = controller.prepare_data(controller.batch(step).groups, step)
    return prepared.info, prepared


def prepare_data(ctx: PhaseContext, step: int) -> Prepared:
    return Prepared(*ctx.workers.keep("controller", _prepare_on, step))


def _fit_on(trainer: TrainingWorker, sequences: Any, step: int) -> dict[str, float]:
    return trainer.fit(sequences, step).metrics


def fit(ctx: PhaseContext, step: int, prepared: Prepared) -> dict[str, float]:
    return each(ctx.workers, "trainer", _fit_on, prepared.sequences, step)[0]  # every rank reports the whole step


# -- weights --------------------------------------------------------------------------------------------


def _save_trainer_on(trainer: TrainingWorker, checkpoint: Store, save_optimizer: bool) -> None:
    trainer.save_checkpoint(checkpoint, save_optimizer=save_optimizer)


def save_checkpoint(ctx: PhaseContext, step: int) -> str:
    """Every worker writes its part of the checkpoint at once; ``commit_checkpoint`` seals it."""
    config = ctx.config
    uri = begin_checkpoint(config, step)
    calls = [Call("controller", Controller.save_checkpoint, (uri,))]
    if "trainer" in ctx.workers.roles:
        calls.append(Call("trainer", _save_trainer_on, (Store(uri, config.storage_options), not config.checkpoint_no_save_optimizer)))
    ctx.workers.run(*calls)
    return uri


def export_hf(ctx: PhaseContext, step: int) -> str:
    """``save_pretrained`` model + tokenizer under ``{run}/hf/step-NNNNNN``; every rank gathers, rank 0 writes."""
    config = ctx.config
    uri = begin_hf_export(config, step)
    each(ctx.workers, "trainer", TrainingWorker.export_hf, Store(uri, config.storage_options), config.tokenizer_source)
    seal_hf_export(config, step)
    return uri


def sync_weights(ctx: PhaseContext, step: int) -> dict[str, float]:
    """Trainer weights reach the rollout with no disk round trip (CUDA IPC on a shared GPU, an NCCL
    broadcast between GPUs, else the object store: ``engine.cluster.weight_sync``), and every engine
    shows it holds them before any rollout uses them (``engine.weights.attestation``)."""
    return ctx.workers.sync_weights(step)


def check_rollout(ctx: PhaseContext, step: int) -> dict[str, float]:
    """Before a weight sync: every rollout engine's heartbeat; a dead or hung one is replaced by a fresh
    engine, which the sync then gives the trainer's weights (``engine.cluster.health``)."""
    return ctx.workers.check_rollout_health()


def _trainer_print_on(trainer: TrainingWorker) -> dict:
    return fingerprint(trainer.export_weights())  # every rank takes part in gathering the full tensors


def _served_print_on(engine: Any) -> dict:
    return fingerprint(engine.served_weights())


def check_weights(ctx: PhaseContext, step: int) -> dict[str, float]:
    """After a sync, every rollout engine serves the trainer's weights: their fingerprints agree
    (``engine.weights.fingerprint``); otherwise the step fails with the tensors that differ."""
    trainer, served = ctx.workers.run(Call("trainer", _trainer_print_on), Call("rollout", _served_print_on))
    differences = [largest_difference(trainer[0], prints, engine=f"rollout engine {index}") for index, prints in enumerate(served)]
    return {"weights/checked_tensors": float(len(trainer[0])), "weights/largest_difference": max(differences)}


# -- evaluation and records -----------------------------------------------------------------------------


def _evaluate_on(controller: Controller, engines: Any, step: int, origin: str | None, records: bool) -> Evaluation:
    groups, metrics = controller.evaluate(step, engines)
    return Evaluation(controller.write_trajectories(groups, step, "eval", origin)[0] if records else "", metrics)


def evaluate(ctx: PhaseContext, step: int) -> Evaluation:
    return ctx.workers.drive(_evaluate_on, step, ctx.origin, ctx.plan.keeps_records)


def log_step(ctx: PhaseContext, step: int, record: StepRecord) -> Logged:
    """The step's metrics to the run's trackers and text log; the run counters with the step added."""
    metrics, counters = assemble_step_metrics(record, ctx.plan.devices, shared_devices=not ctx.config.disaggregated)
    ctx.workers.log_metrics(metrics, step)
    if ctx.plan.keeps_records:
        record_step(ctx.config, step, metrics)
    return Logged(metrics, counters)


def commit_checkpoint(ctx: PhaseContext, step: int, counters: RunCounters) -> str:
    seal_checkpoint(ctx.config, step, train_state(step, counters))
    return f"{ctx.config.checkpoint_uri}/{step_name(step)}"


def log_evaluation(ctx: PhaseContext, step: int, evaluation: Evaluation) -> dict[str, float]:
    """The initial evaluation (step 0), before any training."""
    metrics = {f"eval/{k}": v for k, v in evaluation.metrics.items()}
    ctx.workers.log_metrics(metrics, step)
    return metrics


# -- the table --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retries:
    count: int
    delay_s: float = 1.0
    unless_setting_error: bool = True  # a setting the user must change would fail the retry too


RETRIED, ONCE, NEVER = Retries(2), Retries(1, unless_setting_error=False), Retries(0)

# What a phase publishes besides its result: "metrics" join the step's metrics; the others are Prefect
# artifacts in the flow (the step's metrics table, its links, the checkpoint's, the evaluation's).
Publish = Literal["metrics", "metrics_table", "step_links", "checkpoint_link", "eval_link", "guard_page"]


def replace_lost_rollout(ctx: PhaseContext) -> None:
    """A retried phase's first suspect: a lost rollout worker, replaced and given the trainer's weights."""
    ctx.workers.replace_lost_rollout()


def _restart_on(controller: Controller, engines: Any) -> None:
    _continue_on(controller, engines, None)


def restart_producer(ctx: PhaseContext) -> None:
    """A retried get_batch: the producer starts again on the (perhaps replaced) rollout workers."""
    ctx.workers.drive(_restart_on)


@dataclass(frozen=True)
class OnRetry:
    """What a retried phase does first, and how the run log says it."""

    doing: str
    fn: Callable[[PhaseContext], None]


LOST_ROLLOUT = OnRetry("replacing lost rollout workers", replace_lost_rollout)
PRODUCER = OnRetry("restarting the producer", restart_producer)


@dataclass(frozen=True)
class Phase:
    name: str  # the task name, the timer and the time/* metric
    role: Role  # whose workers it drives: the controller, the trainer ranks or the rollout engines
    body: Callable[..., Any]  # body(ctx, step, *inputs)
    retries: Retries = RETRIED
    on_retry: tuple[OnRetry, ...] = (LOST_ROLLOUT,)
    publishes: tuple[Publish, ...] = ()
    needs: Role | None = None  # the side that holds the shared accelerator while it runs (colocated)


# name, role, body; then what differs from a retried, idempotent phase whose retry first replaces lost rollout workers
PRODUCE_BATCH = Phase("produce_batch", "controller", produce_batch, needs="rollout")
START_ROLLOUT = Phase("start_rollout", "controller", start_rollout, needs="rollout")
LOAD_BATCH = Phase("load_batch", "controller", load_batch)
GET_BATCH = Phase("get_batch", "controller", get_batch, on_retry=(LOST_ROLLOUT, PRODUCER))
WRITE_TRAJECTORIES = Phase("write_trajectories", "controller", write_trajectories)  # a part is replaced, not appended
PREPARE_DATA = Phase("prepare_data", "controller", prepare_data)
FIT = Phase("fit", "trainer", fit, retries=NEVER, on_retry=(), publishes=("metrics",), needs="trainer")  # refuses a step it applied
SAVE_CHECKPOINT = Phase("save_checkpoint", "trainer", save_checkpoint, retries=ONCE, on_retry=())  # a retry starts afresh
EXPORT_HF = Phase("export_hf", "trainer", export_hf, retries=ONCE, on_retry=())
PAUSE_PRODUCE = Phase("pause_produce", "controller", pause_produce, on_retry=())
CHECK_ROLLOUT = Phase("check_rollout", "rollout", check_rollout, on_retry=(), publishes=("metrics",))  # it replaces what it finds
SYNC_WEIGHTS = Phase("sync_weights", "rollout", sync_weights, publishes=("metrics",))  # an attestation failure is not retried: it synced again already
CHECK_WEIGHTS = Phase("check_weights", "rollout", check_weights, publishes=("metrics",))
CHECK_STABILITY = Phase("check_stability", "controller", check_stability, on_retry=())
ROLL_BACK = Phase("roll_back", "controller", roll_back, retries=NEVER, on_retry=(), publishes=("guard_page",))  # a failed one: the run resumes
EVALUATE = Phase("evaluate", "controller", evaluate, publishes=("metrics",), needs="rollout")
CONTINUE_PRODUCE = Phase("continue_produce", "controller", continue_produce)
LOG_STEP = Phase("log_step", "controller", log_step, on_retry=(), publishes=("metrics_table", "step_links"))
COMMIT_CHECKPOINT = Phase("commit_checkpoint", "controller", commit_checkpoint, on_retry=(), publishes=("checkpoint_link",))
LOG_EVALUATION = Phase("log_evaluation", "controller", log_evaluation, on_retry=(), publishes=("eval_link",))

PHASES: dict[str, Phase] = {
    phase.name: phase
    for phase in (
        PRODUCE_BATCH, START_ROLLOUT, LOAD_BATCH, GET_BATCH, WRITE_TRAJECTORIES, PREPARE_DATA, FIT, CHECK_STABILITY, ROLL_BACK,
        SAVE_CHECKPOINT, EXPORT_HF, PAUSE_PRODUCE, CHECK_ROLLOUT, SYNC_WEIGHTS, CHECK_WEIGHTS, EVALUATE, CONTINUE_PRODUCE, LOG_STEP,
        COMMIT_CHECKPOINT, LOG_EVALUATION,
    )
}


def run_phase(phase: Phase, ctx: PhaseContext, step: int, *inputs: Any) -> Any:
    """The generic phase runner: the colocated switch the phase needs, then its body, its calls named after it."""
    ctx = replace(ctx, workers=ctx.workers.named(phase.name))
    if phase.needs is not None:
        ctx.workers.hand_accelerator_to(phase.needs)
    return phase.body(ctx, step, *inputs)
