"""The run around the steps, written once for both runners: the initial evaluation, the producer
started, the steps in turn (a disaggregated step whose batch expired goes again; a step the stability
guard rolled back goes on from the step after the checkpoint it went back to), the producer paused,
the trackers closed and the run's report published.

The flow (``flows.rl_train``) hands it a runner of Prefect tasks and runs each step as a flow run of its
own; the in-process runner (``engine.run.local``) hands it plain calls. Where the run starts (attaching
or building the workers, the resume decision, the run plan, which flow run owns the run) is each
runner's own: it comes before, in ``RunPlan``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from trellis.engine.config import TrellisConfig
from trellis.engine.run.metrics import RunCounters
from trellis.engine.run.phases import CONTINUE_PRODUCE, EVALUATE, LOG_EVALUATION, PAUSE_PRODUCE, Phase, PhaseContext, run_phase
from trellis.engine.run.plan import RunPlan
from trellis.engine.run.results import Done, StepOutcome
from trellis.engine.run.run_log import run_log_for
from trellis.engine.run.step import PhaseRunner
from trellis.engine.run.tracing import close_tracer
from trellis.engine.storage.report import Report, write_report
from trellis.engine.storage.store import Store


class Progress(Protocol):
    step: int | None  # the step under way, for the record of a failure


def run_steps(
    runner: PhaseRunner,
    config: TrellisConfig,
    plan: RunPlan,
    run_one: Callable[[int, RunCounters], StepOutcome],
    *,
    first_step: int | None = None,
    counters: RunCounters | None = None,
    progress: Progress | None = None,
    on_step: Callable[[StepOutcome], None] | None = None,
) -> list[StepOutcome]:
    """Steps ``first_step`` (the plan's by default) to the plan's last, each by ``run_one(step, counters)``;
    returns the outcome of each step that trained (and the initial evaluation's, as step 0)."""
    step = plan.first_step if first_step is None else first_step
    counters = plan.counters if counters is None else counters
    outcomes: list[StepOutcome] = []

    def done(outcome: StepOutcome) -> None:
        outcomes.append(outcome)
        if on_step is not None:
            on_step(outcome)

    if plan.initial_evaluation and step == plan.first_step:
        metrics = runner.run(LOG_EVALUATION, 0, runner.run(EVALUATE, 0))
        done(StepOutcome(0, metrics, counters, (EVALUATE.name, LOG_EVALUATION.name)))
    producing = config.disaggregated and step <= plan.total_steps
    if producing:
        runner.run(CONTINUE_PRODUCE, step - 1)  # the producer starts with the weights the run starts from
    while step <= plan.total_steps:
        if progress is not None:
            progress.step = step
        outcome = run_one(step, counters)
        counters = outcome.counters
        if outcome.rolled_back_to is not None:  # the stability guard took the run back to a checkpoint
            step = outcome.rolled_back_to + 1
        elif outcome.advanced:  # a disaggregated step whose batch expired synced weights and goes again
            done(outcome)
            step += 1
    if producing:
        runner.run(PAUSE_PRODUCE, plan.total_steps)
    runner.close_trackers()
    if plan.keeps_records:
        runner.publish_report()
    return outcomes


def write_run_report(config: TrellisConfig) -> Report | None:
    """The run's report (``engine.storage.report``) beside it. A report that cannot be drawn is a warning in
    the run log, never a failed run."""
    try:
        return write_report(Store(config.run_uri, config.storage_options))
    except Exception as error:
        run_log_for(config).warning(f"no report: {type(error).__name__}: {error}")
        return None


class DirectRunner:
    """Runs the phases as plain calls over ``ctx.workers``: the in-process runner's, or a script's on a
    cluster without Prefect. A phase runs at once, also one that could run beside the next."""

    def __init__(self, ctx: PhaseContext) -> None:
        self.ctx = ctx
        self.config = ctx.config

    def run(self, phase: Phase, step: int, *inputs: Any) -> Any:
        return run_phase(phase, self.ctx, step, *inputs)

    def submit(self, phase: Phase, step: int, *inputs: Any) -> Done[Any]:
        return Done(self.run(phase, step, *inputs))

    def close_trackers(self) -> None:
        self.ctx.workers.close_trackers()
        close_tracer(self.ctx.config)

    def publish_report(self) -> None:
        write_run_report(self.ctx.config)

    def trace_attributes(self) -> dict[str, str]:
        return {}

    def announce_trace(self, trace_id: str, step: int) -> None:
        """The trace is the run's own: nothing else to point at it."""
