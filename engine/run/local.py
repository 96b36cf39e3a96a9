"""The whole RL loop in one process: no Prefect, no Ray. For notebooks, scripts, tests and benchmarks.

It builds every engine part from the config, resolves the same ``RunPlan`` as the flow, and runs the
same ``run_steps`` (``engine.run.loop``) and ``run_step`` (``engine.run.step``) over the same phases
(``engine.run.phases``), called on plain objects (``LocalWorkers``), so both runners produce the same
phases in the same order, and the same rows and metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from trellis.engine.config import TrellisConfig
from trellis.engine.data.prompts import SkipReport
from trellis.engine.devices import resolve_device, rollout_device, set_up_process
from trellis.engine.rollout.backends.registry import build_rollout_backend
from trellis.engine.rollout.production.controller import Controller
from trellis.engine.run.loop import DirectRunner, run_steps
from trellis.engine.run.metrics import RunCounters
from trellis.engine.run.phases import PhaseContext
from trellis.engine.run.plan import (
    RunPlan,
    WorkerFacts,
    plan_step,
    record_run_config,
    record_run_plan,
    resolve_run_plan,
    resolve_total_steps,
    roles_for,
)
from trellis.engine.run.preflight import check_inputs
from trellis.engine.run.resume import StartPlan, plan_start
from trellis.engine.run.results import StepOutcome
from trellis.engine.run.run_log import record_start
from trellis.engine.run.step import run_step
from trellis.engine.run.workers import LocalWorkers
from trellis.engine.secrets import write_runtime_environment
from trellis.engine.storage.checkpoints import require_complete
from trellis.engine.storage.store import Store
from trellis.engine.storage.ledger import forget_after
from trellis.engine.storage.lineage import record_run_origin
from trellis.engine.storage.trackers import Trackers
from trellis.engine.train.worker import TrainingWorker

logger = logging.getLogger(__name__)


@dataclass
class StepReport:
    step: int
    metrics: dict[str, float]
    phases: tuple[str, ...] = ()


class LocalRun:
    """Builds the workers a run needs as plain objects and runs its steps in this process.

    With ``track`` (the default) it writes what the flow writes: env.json, the trajectories as
    Parquet, metrics.jsonl and TensorBoard events, checkpoints and HF exports; benchmarks turn it off
    to time the engine alone. ``resume`` continues from the latest complete checkpoint (as
    ``auto_resume`` does).
    """

    def __init__(self, config: TrellisConfig, *, track: bool = True, resume: bool = False) -> None:
        if config.train_resources.num_workers > 1 or config.rollout_resources.num_workers > 1:
            raise ValueError(
                "The in-process runner holds one trainer and one rollout worker; several trainer ranks or rollout "
                "workers run as Ray actors: launch the run without --in-process."
            )
        check_inputs(config)
        set_up_process(config)
        self.config = config
        roles = roles_for(config)
        self.controller = Controller(config)
        total = resolve_total_steps(config, self.controller.dataset_size)
        self.backend = build_rollout_backend(config, self.controller.tokenizer) if "rollout" in roles else None
        self.worker = None
        if "trainer" in roles:
            self.worker = TrainingWorker(config, total_train_steps=total, pad_token_id=self.controller.pad_token_id)
        start = plan_start(config, resume=resume) if track else StartPlan(action="fresh", step=0)
        state = self._restore(start.checkpoint) if start.checkpoint is not None else None
        self.plan: RunPlan = resolve_run_plan(config, self._facts(), start, RunCounters.resumed(state), keeps_records=track)
        trackers = Trackers(config, self.plan.first_step) if track else None
        self.workers = LocalWorkers(config, roles, self.controller, self.worker, self.backend, trackers)
        if track:
            write_runtime_environment(config.run_uri, config.storage_options)
            record_run_config(config)
            record_run_plan(config, self.plan)
            record_start(config, self.plan)
            record_run_origin(config, start)
            forget_after(Store(config.run_uri, config.storage_options), start.step)  # the ledger of the steps to be run again
        self.step = start.step
        self.counters = self.plan.counters
        self._runner = DirectRunner(PhaseContext(config, self.plan, self.workers))

    @property
    def train_report(self) -> SkipReport:
        return self.controller.train_report

    @property
    def total_train_steps(self) -> int:
        return self.plan.total_steps

    def _facts(self) -> WorkerFacts:
        return WorkerFacts(
            dataset_size=self.controller.dataset_size,
            pad_token_id=self.controller.pad_token_id,
            train_report=self.controller.train_report.summary(),
            applied_step=self.worker.applied_step if self.worker is not None else 0,
            holds_state=False,
            rollout_on_gpu=self.backend is not None and rollout_device(self.config).type == "cuda",
            train_on_gpu=self.worker is not None and resolve_device(self.config.train_worker.device).type == "cuda",
        )

    def _restore(self, uri: str) -> dict[str, float | int]:
        load = self.config.load_checkpoint_cfg
        state = require_complete(Store(uri, self.config.storage_options))
        if self.worker is not None:
            self.worker.load_checkpoint(Store(uri, self.config.storage_options), load_optimizer=load.load_optimizer_states,
                                        load_scheduler=load.load_scheduler)
            if self.backend is not None:
                self.backend.load_weights(self.worker.export_weights(), policy_version=int(state["policy_version"]))
        self.controller.load_checkpoint(uri, load_dataset=load.load_dataset)
        logger.info("Resumed from %s at step %d", uri, int(state["step"]))
        return state

    def _run_one(self, step: int, counters: RunCounters) -> StepOutcome:
        outcome = run_step(self._runner, plan_step(self.config, self.plan, step), counters)
        self.counters = outcome.counters
        if outcome.rolled_back_to is not None:
            self.step = outcome.rolled_back_to
        elif outcome.advanced:
            self.step = outcome.step
        return outcome

    def train_step(self) -> StepReport:
        """The next step; a disaggregated step whose batch expired syncs weights and goes again, and after a
        rollback of the stability guard, the step after the checkpoint it went back to."""
        while not (outcome := self._run_one(self.step + 1, self.counters)).advanced:
            pass
        return StepReport(outcome.step, outcome.metrics, outcome.phases)

    def run(self, on_step: Callable[[StepReport], None] | None = None) -> list[StepReport]:
        """The rest of the run, as the flow runs it (``run_steps``): the initial evaluation, the steps, then
        the trackers closed and the run's report written."""
        def report(outcome: StepOutcome) -> StepReport:
            return StepReport(outcome.step, outcome.metrics, outcome.phases)

        outcomes = run_steps(
            self._runner, self.config, self.plan, self._run_one, first_step=self.step + 1, counters=self.counters,
            on_step=None if on_step is None else lambda outcome: on_step(report(outcome)),
        )
        return [report(outcome) for outcome in outcomes]

    def close(self) -> None:
        self.controller.close()
        self.workers.close_trackers()

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
