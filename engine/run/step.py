"""One RL step, in the order of XTuner v1's colocated trainer, written once for both runners.

``run_step`` calls the phases a ``StepPlan`` says are due, in this order:

    produce_batch (or load_batch) ─► write_trajectories (runs beside the next phases)
        └─► prepare_data ─► fit ─► check_stability? ─► save_checkpoint? ─► export_hf? ─► check_rollout? ─► sync_weights?
            ─► check_weights? ─► evaluate? ─► start_rollout[step+1]? ─► log_step ─► commit_checkpoint?
                                  └─ tripped ─► roll_back (the run goes on after the checkpoint it went back to)

Each phase is a row of ``engine.run.phases``; a runner runs it. The Prefect flow's runner makes each a
named task run of the step's flow run, driving Ray actors (``tasks.phases``); the in-process runner
calls it on plain objects (``engine.run.local``). Two changes of order from the reference:

- a checkpoint's files are written where the reference saves (after ``fit``), but it is sealed by
  ``commit_checkpoint`` after ``log_step``, so a complete checkpoint means its step is fully recorded;
- the next step's rollout is launched once this step's weights are synced and evaluated, before its
  records are written, so that the records (and, in the flow, the Prefect API calls that end one step
  flow run and start the next) overlap generation instead of leaving the workers idle.

The disaggregated trainer's step (``plan.disaggregated``) takes its batch from the replay buffer that
a producer fills beside it, and pauses the producer only around a weight sync:

    get_batch ─► write_trajectories (beside) ─► prepare_data ─► fit ─► check_stability?
        (tripped ─► pause_produce ─► roll_back ─► continue_produce)
        ─► [check_rollout? ─► pause_produce ─► save_checkpoint? ─► export_hf? ─► sync_weights ─► check_weights?
            ─► evaluate? ─► continue_produce]
        ─► log_step ─► commit_checkpoint?

An empty batch marked expired means the producer waits for weights the trainer already has: the step
syncs them and is tried again (``StepOutcome.advanced`` is False), as XTuner's does.

Phase names are the task names, the timer names and the ``time/*`` metric names alike.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Protocol

from trellis.engine.config import TrellisConfig
from trellis.engine.run.guard import Trip
from trellis.engine.run.metrics import RunCounters, StepRecord, timer, update_metrics
from trellis.engine.run.phases import (
    CHECK_ROLLOUT,
    CHECK_STABILITY,
    CHECK_WEIGHTS,
    COMMIT_CHECKPOINT,
    CONTINUE_PRODUCE,
    EVALUATE,
    EXPORT_HF,
    FIT,
    GET_BATCH,
    LOAD_BATCH,
    LOG_STEP,
    PAUSE_PRODUCE,
    PREPARE_DATA,
    PRODUCE_BATCH,
    ROLL_BACK,
    SAVE_CHECKPOINT,
    START_ROLLOUT,
    SYNC_WEIGHTS,
    WRITE_TRAJECTORIES,
    Phase,
)
from trellis.engine.run.plan import StepPlan
from trellis.engine.run.rollback import RolledBack
from trellis.engine.run.results import BatchHandle, Evaluation, Logged, Pending, Prepared, StepOutcome
from trellis.engine.run.tracing import step_span, tracer_for

BATCH_SOURCES = {phase.name: phase for phase in (PRODUCE_BATCH, LOAD_BATCH, GET_BATCH)}


class PhaseRunner(Protocol):
    """Runs a phase of ``engine.run.phases`` (and the two ends of a run) as one runner does."""

    config: TrellisConfig

    def run(self, phase: Phase, step: int, *inputs: Any) -> Any: ...
    def submit(self, phase: Phase, step: int, *inputs: Any) -> Pending[Any]: ...
    def close_trackers(self) -> None: ...
    def publish_report(self) -> None: ...
    def trace_attributes(self) -> dict[str, str]: ...  # the runner's own ids on a traced step's span
    def announce_trace(self, trace_id: str, step: int) -> None: ...  # where a traced step's trace id is told


class StepPhases:
    """One step's phases as they run: their order, the time of each (the ``time/*`` metrics), and their
    spans when the run is traced (``engine.run.tracing``)."""

    def __init__(self, runner: PhaseRunner, step: int) -> None:
        self.runner, self.step = runner, step
        self.ran: list[str] = []
        self.timings: dict[str, float] = {}
        self.links: dict[str, str] = {}
        self.metrics: dict[str, float] = {}  # of the phases that publish metrics beside fit's and evaluate's
        self.started_s = time.time()
        self.tracer = tracer_for(runner.config)

    def __call__(self, phase: Phase, *inputs: Any, step: int | None = None) -> Any:
        """Run ``phase`` (for ``step``, this step by default), timed."""
        self.ran.append(phase.name)
        with timer(phase.name, self.timings):
            return self._run(phase, self.step if step is None else step, *inputs)

    def untimed(self, phase: Phase, *inputs: Any) -> Any:
        self.ran.append(phase.name)
        return self._run(phase, self.step, *inputs)

    def beside(self, phase: Phase, *inputs: Any) -> Pending[Any]:
        """A phase that runs beside the next ones; traced, its span covers its submission only."""
        self.ran.append(phase.name)
        with self.tracer.phase(phase.name, self.step) if self.tracer else nullcontext():
            return self.runner.submit(phase, self.step, *inputs)

    def _run(self, phase: Phase, step: int, *inputs: Any) -> Any:
        if self.tracer is None:
            return self.runner.run(phase, step, *inputs)
        with self.tracer.phase(phase.name, step):
            result = self.runner.run(phase, step, *inputs)
            if isinstance(result, BatchHandle) and result.sample_spans:
                self.tracer.samples(result.sample_spans)
            return result

    def finish(self, plan: StepPlan, record: StepRecord, sealed: bool) -> StepOutcome:
        """log_step, then the checkpoint's seal: a complete checkpoint promises its step is fully recorded."""
        logged: Logged = self.untimed(LOG_STEP, record)
        if sealed:
            self.untimed(COMMIT_CHECKPOINT, logged.counters)
        return StepOutcome(plan.step, logged.metrics, logged.counters, tuple(self.ran))

    def record(self, batch: BatchHandle, prepared: Prepared, fit_metrics: dict[str, float], eval_metrics: dict[str, float],
               counters: RunCounters) -> StepRecord:
        return StepRecord(self.timings, batch.metrics, prepared.info, fit_metrics, eval_metrics, counters, self.links, self.metrics)


def run_step(runner: PhaseRunner, plan: StepPlan, counters: RunCounters) -> StepOutcome:
    with step_span(runner.config, plan.step, runner.trace_attributes(), runner.announce_trace):
        if plan.disaggregated:
            return run_disaggregated_step(runner, plan, counters)
        return run_colocated_step(runner, plan, counters)


def run_colocated_step(runner: PhaseRunner, plan: StepPlan, counters: RunCounters) -> StepOutcome:
    phases = StepPhases(runner, plan.step)
    batch: BatchHandle = phases(BATCH_SOURCES[plan.batch_source])
    written = phases.beside(WRITE_TRAJECTORIES) if plan.write_trajectories else None
    prepared: Prepared = phases(PREPARE_DATA)
    fit_metrics: dict[str, float] = phases(FIT, prepared) if plan.fit else {}
    if (trip := check_stability(phases, plan, batch, prepared, fit_metrics)) is not None:
        return roll_back_step(phases, plan, trip, written, counters)
    save_and_export(phases, plan)
    sync_and_check(phases, plan)
    if written is not None:
        phases.links["trajectories"] = written.result()
    eval_metrics = evaluate_if_due(phases, plan)
    phases.timings["step"] = time.time() - min(phases.started_s, batch.launched_s)  # from the launch of its rollout
    if plan.launch_next_rollout:
        phases.ran.append(START_ROLLOUT.name)
        runner.run(START_ROLLOUT, plan.step + 1)
    return phases.finish(plan, phases.record(batch, prepared, fit_metrics, eval_metrics, counters), plan.save_checkpoint)


def run_disaggregated_step(runner: PhaseRunner, plan: StepPlan, counters: RunCounters) -> StepOutcome:
    step, phases = plan.step, StepPhases(runner, plan.step)
    batch: BatchHandle = phases(GET_BATCH)
    if batch.waits_for_weights:  # the producer waits for step - 1's weights
        phases(PAUSE_PRODUCE)
        phases(SYNC_WEIGHTS, step=step - 1)
        phases(CONTINUE_PRODUCE, step=step - 1)
        return StepOutcome(step, {}, counters, tuple(phases.ran), advanced=False)
    written = phases.beside(WRITE_TRAJECTORIES)
    prepared: Prepared = phases(PREPARE_DATA)
    fit_metrics: dict[str, float] = phases(FIT, prepared)
    if (trip := check_stability(phases, plan, batch, prepared, fit_metrics)) is not None:
        phases(PAUSE_PRODUCE)
        return roll_back_step(phases, plan, trip, written, counters)
    eval_metrics: dict[str, float] = {}
    synced = plan.sync_weights or batch.expired
    if synced:
        if plan.check_rollout:  # first: a hung engine would hold up the pause
            phases.metrics.update(phases(CHECK_ROLLOUT))
        phases(PAUSE_PRODUCE)
        save_and_export(phases, plan)
        phases.metrics.update(phases(SYNC_WEIGHTS))
        if plan.check_weights:
            phases.metrics.update(phases(CHECK_WEIGHTS))
        eval_metrics = evaluate_if_due(phases, plan)
        phases(CONTINUE_PRODUCE)
    phases.links["trajectories"] = written.result()
    phases.timings["step"] = time.time() - phases.started_s
    record = phases.record(batch, prepared, fit_metrics, eval_metrics, counters)
    return phases.finish(plan, record, plan.save_checkpoint and synced)


def check_stability(phases: StepPhases, plan: StepPlan, batch: BatchHandle, prepared: Prepared,
                    fit_metrics: dict[str, float]) -> Trip | None:
    """The stability guard's rules over the step's metrics once its update is applied (when enabled)."""
    if not plan.check_stability:
        return None
    return phases(CHECK_STABILITY, update_metrics(batch.metrics, prepared.info, fit_metrics))


def roll_back_step(phases: StepPhases, plan: StepPlan, trip: Trip, written: Pending[str] | None,
                   counters: RunCounters) -> StepOutcome:
    """A tripped guard: the step goes no further; the run goes back to a good checkpoint and on from there."""
    if written is not None:
        written.result()  # its partition is set aside with the step's other records
    rolled: RolledBack = phases(ROLL_BACK, trip, counters, time.time() - phases.started_s)
    if plan.disaggregated:
        phases(CONTINUE_PRODUCE, step=rolled.to_step)
    return StepOutcome(plan.step, {}, rolled.counters, tuple(phases.ran), advanced=False, rolled_back_to=rolled.to_step)


def save_and_export(phases: StepPhases, plan: StepPlan) -> None:
    """The step's checkpoint files and HF export, when due (the checkpoint is sealed after log_step)."""
    if plan.save_checkpoint:
        phases(SAVE_CHECKPOINT)
    if plan.export_hf:
        phases.links["hf-export"] = phases(EXPORT_HF)


def sync_and_check(phases: StepPhases, plan: StepPlan) -> None:
    if plan.check_rollout:
        phases.metrics.update(phases(CHECK_ROLLOUT))
    if plan.sync_weights:
        phases.metrics.update(phases(SYNC_WEIGHTS))
    if plan.check_weights:
        phases.metrics.update(phases(CHECK_WEIGHTS))


def evaluate_if_due(phases: StepPhases, plan: StepPlan) -> dict[str, float]:
    if not plan.evaluate:
        return {}
    evaluation: Evaluation = phases(EVALUATE)
    phases.links["eval-trajectories"] = evaluation.uri
    return evaluation.metrics
