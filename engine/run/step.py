"""One RL step, in the order of XTuner v1's colocated trainer, written once for both runners.

``run_step`` calls the phases a ``StepPlan`` says are due, in this order:

    produce_batch (or load_batch) ─► write_trajectories (runs beside the next phases)
        └─► prepare_data ─► fit ─► save_checkpoint? ─► export_hf? ─► sync_weights? ─► evaluate?
            ─► start_rollout[step+1]? ─► log_step ─► commit_checkpoint?

The Prefect flow passes phases that are Prefect tasks driving Ray actors (``tasks.phases``), so each
phase is a named task run of the step's flow run; the in-process runner passes plain method calls
(``engine.run.local``). Two changes of order from the reference:

- a checkpoint's files are written where the reference saves (after ``fit``), but it is sealed by
  ``commit_checkpoint`` after ``log_step``, so a complete checkpoint means its step is fully recorded;
- the next step's rollout is launched once this step's weights are synced and evaluated, before its
  records are written, so that the records (and, in the flow, the Prefect API calls that end one step
  flow run and start the next) overlap generation instead of leaving the workers idle.

The disaggregated trainer's step (``plan.disaggregated``) takes its batch from the replay buffer that
a producer fills beside it, and pauses the producer only around a weight sync:

    get_batch ─► write_trajectories (beside) ─► prepare_data ─► fit
        ─► [pause_produce ─► save_checkpoint? ─► export_hf? ─► sync_weights ─► evaluate? ─► continue_produce]
        ─► log_step ─► commit_checkpoint?

An empty batch marked expired means the producer waits for weights the trainer already has: the step
syncs them and is tried again (``StepOutcome.advanced`` is False), as XTuner's does.

Phase names are the task names, the timer names and the ``time/*`` metric names alike.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from engine.run.metrics import RunCounters, StepRecord, timer
from engine.run.plan import RunPlan, StepPlan

T = TypeVar("T", covariant=True)


class Pending(Protocol[T]):
    """A phase that runs beside the following ones; ``result`` waits for it."""

    def result(self) -> T: ...


@dataclass(frozen=True)
class Done(Generic[T]):
    """A phase that already ran (the in-process runner writes its trajectories at once)."""

    value: T

    def result(self) -> T:
        return self.value


@dataclass(frozen=True)
class Batch:
    """A produced (or stored) batch: a few numbers for the orchestrator, the samples themselves (an
    object-store reference or the in-process result), and the wall time its rollout was launched,
    perhaps during the previous step."""

    summary: dict[str, float]
    samples: Any
    launched_s: float = math.inf


@dataclass(frozen=True)
class Prepared:
    info: dict[str, float]  # response/* statistics and the training sample and token counts
    sequences: Any


@dataclass(frozen=True)
class Evaluation:
    uri: str  # where the evaluation's trajectories landed ("" when not recorded)
    metrics: dict[str, float]


@dataclass(frozen=True)
class Logged:
    metrics: dict[str, float]
    counters: RunCounters


@dataclass(frozen=True)
class StepOutcome:
    step: int
    metrics: dict[str, float]
    counters: RunCounters
    phases: tuple[str, ...]  # the phases that ran, in their order
    advanced: bool = True  # False: no training happened (an expired batch); the step is run again


class StepPhases(Protocol):
    """The phases of a step and of the run around it, as one runner implements them."""

    def produce_batch(self, step: int) -> Batch: ...
    def load_batch(self, step: int) -> Batch: ...
    def write_trajectories(self, step: int, batch: Batch) -> Pending[str]: ...
    def prepare_data(self, step: int, batch: Batch) -> Prepared: ...
    def fit(self, step: int, prepared: Prepared) -> dict[str, float]: ...
    def save_checkpoint(self, step: int) -> str: ...
    def export_hf(self, step: int) -> str: ...
    def sync_weights(self, step: int) -> None: ...
    def evaluate(self, step: int) -> Evaluation: ...
    def start_rollout(self, step: int) -> None: ...
    def log_step(self, step: int, record: StepRecord) -> Logged: ...
    def commit_checkpoint(self, step: int, counters: RunCounters) -> str: ...
    def log_evaluation(self, step: int, evaluation: Evaluation) -> dict[str, float]: ...
    def get_batch(self, step: int) -> Batch: ...
    def pause_produce(self, step: int) -> float: ...
    def continue_produce(self, step: int) -> None: ...


def run_step(phases: StepPhases, plan: StepPlan, counters: RunCounters) -> StepOutcome:
    if plan.disaggregated:
        return run_disaggregated_step(phases, plan, counters)
    step, timings, ran = plan.step, {}, []
    started_s = time.time()

    def phase(name: str):
        ran.append(name)
        return timer(name, timings)

    with phase(plan.batch_source):
        batch = phases.load_batch(step) if plan.batch_source == "load_batch" else phases.produce_batch(step)
    written = None
    if plan.write_trajectories:
        ran.append("write_trajectories")
        written = phases.write_trajectories(step, batch)
    with phase("prepare_data"):
        prepared = phases.prepare_data(step, batch)
    fit_metrics: dict[str, float] = {}
    if plan.fit:
        with phase("fit"):
            fit_metrics = phases.fit(step, prepared)
    links: dict[str, str] = {}
    save_and_export(phases, plan, phase, links)
    if plan.sync_weights:
        with phase("sync_weights"):
            phases.sync_weights(step)
    if written is not None:
        links["trajectories"] = written.result()
    eval_metrics = evaluate_if_due(phases, plan, phase, links)
    timings["step"] = time.time() - min(started_s, batch.launched_s)  # from the launch of its rollout
    if plan.launch_next_rollout:
        ran.append("start_rollout")
        phases.start_rollout(step + 1)
    ran.append("log_step")
    record = StepRecord(timings, batch.summary, prepared.info, fit_metrics, eval_metrics, counters, links)
    logged = phases.log_step(step, record)
    if plan.save_checkpoint:  # sealed last: a complete checkpoint promises its step is fully recorded
        ran.append("commit_checkpoint")
        phases.commit_checkpoint(step, logged.counters)
    return StepOutcome(step, logged.metrics, logged.counters, tuple(ran))


def run_disaggregated_step(phases: StepPhases, plan: StepPlan, counters: RunCounters) -> StepOutcome:
    step, timings, ran = plan.step, {}, []
    started_s = time.time()

    def phase(name: str):
        ran.append(name)
        return timer(name, timings)

    with phase("get_batch"):
        batch = phases.get_batch(step)
    expired = bool(batch.summary.get("expired"))
    if expired and not batch.summary["produced_samples"]:  # the producer waits for step - 1's weights
        with phase("pause_produce"):
            phases.pause_produce(step)
        with phase("sync_weights"):
            phases.sync_weights(step - 1)
        with phase("continue_produce"):
            phases.continue_produce(step - 1)
        return StepOutcome(step, {}, counters, tuple(ran), advanced=False)
    ran.append("write_trajectories")
    written = phases.write_trajectories(step, batch)
    with phase("prepare_data"):
        prepared = phases.prepare_data(step, batch)
    with phase("fit"):
        fit_metrics = phases.fit(step, prepared)
    links, eval_metrics = {}, {}
    if plan.sync_weights or expired:
        with phase("pause_produce"):
            phases.pause_produce(step)
        save_and_export(phases, plan, phase, links)
        with phase("sync_weights"):
            phases.sync_weights(step)
        eval_metrics = evaluate_if_due(phases, plan, phase, links)
        with phase("continue_produce"):
            phases.continue_produce(step)
    links["trajectories"] = written.result()
    timings["step"] = time.time() - started_s
    ran.append("log_step")
    record = StepRecord(timings, batch.summary, prepared.info, fit_metrics, eval_metrics, counters, links)
    logged = phases.log_step(step, record)
    if plan.save_checkpoint and (plan.sync_weights or expired):
        ran.append("commit_checkpoint")
        phases.commit_checkpoint(step, logged.counters)
    return StepOutcome(step, logged.metrics, logged.counters, tuple(ran))


def save_and_export(phases: StepPhases, plan: StepPlan, phase, links: dict[str, str]) -> None:
    """The step's checkpoint files and HF export, when due (the checkpoint is sealed after log_step)."""
    if plan.save_checkpoint:
        with phase("save_checkpoint"):
            phases.save_checkpoint(plan.step)
    if plan.export_hf:
        with phase("export_hf"):
            links["hf-export"] = phases.export_hf(plan.step)


def evaluate_if_due(phases: StepPhases, plan: StepPlan, phase, links: dict[str, str]) -> dict[str, float]:
    if not plan.evaluate:
        return {}
    with phase("evaluate"):
        evaluation = phases.evaluate(plan.step)
    links["eval-trajectories"] = evaluation.uri
    return evaluation.metrics


def run_initial_evaluation(phases: StepPhases, plan: RunPlan) -> dict[str, float] | None:
    """The evaluation before any training (step 0), when the plan asks for it."""
    if not plan.initial_evaluation:
        return None
    return phases.log_evaluation(0, phases.evaluate(0))
