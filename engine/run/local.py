"""The whole RL loop in one process: no Prefect, no Ray. For notebooks, scripts, tests and benchmarks.

It builds every engine part from the config, resolves the same ``RunPlan`` as the flow, and runs each
step with the same ``run_step`` (``engine.run.step``) over phases that are plain method calls, so
both runners produce the same phases in the same order, and the same rows and metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from engine.config import TrellisConfig
from engine.data.prompts import SkipReport
from engine.devices import resolve_device, rollout_device, set_up_process
from engine.rollout.backends.registry import build_rollout_backend
from engine.rollout.production.controller import Controller
from engine.rollout.production.produce import produce_summary
from engine.run.metrics import RunCounters, StepRecord, assemble_step_metrics
from engine.run.plan import (
    RunPlan,
    WorkerFacts,
    plan_step,
    record_run_plan,
    resolve_run_plan,
    resolve_total_steps,
    roles_for,
)
from engine.run.preflight import check_inputs
from engine.run.run_log import record_start, record_step
from engine.storage.ledger import forget_after
from engine.storage.lineage import record_run_origin
from engine.run.resume import (
    StartPlan,
    begin_checkpoint,
    begin_hf_export,
    plan_start,
    seal_checkpoint,
    seal_hf_export,
    train_state,
)
from engine.run.step import (
    Batch,
    Done,
    Evaluation,
    Logged,
    Prepared,
    run_initial_evaluation,
    run_step,
)
from engine.secrets import write_runtime_environment
from engine.storage.checkpoints import require_complete, step_name
from engine.storage.trackers import Trackers
from engine.train.worker import TrainingWorker

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
        self.trackers = Trackers(config, self.plan.first_step) if track else None
        if track:
            write_runtime_environment(config.run_uri, config.storage_options)
            record_run_plan(config, self.plan)
            record_start(config, self.plan)
            record_run_origin(config, start)
            forget_after(config.run_uri, start.step, config.storage_options)  # the ledger of the steps to be run again
        self.step = start.step
        self.counters = self.plan.counters
        self._phases = LocalPhases(self)

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
        state = require_complete(uri, self.config.storage_options)
        if self.worker is not None:
            self.worker.load_checkpoint(uri, self.config.storage_options, load_optimizer=load.load_optimizer_states)
            if self.backend is not None:
                self.backend.load_weights(self.worker.export_weights(), policy_version=int(state["policy_version"]))
        self.controller.load_checkpoint(uri, load_dataset=load.load_dataset)
        logger.info("Resumed from %s at step %d", uri, int(state["step"]))
        return state

    def train_step(self) -> StepReport:
        """The next step; a disaggregated step whose batch expired syncs weights and goes again."""
        while True:
            outcome = run_step(self._phases, plan_step(self.config, self.plan, self.step + 1), self.counters)
            self.counters = outcome.counters
            if outcome.advanced:
                self.step = outcome.step
                return StepReport(outcome.step, outcome.metrics, outcome.phases)

    def run(self, on_step: Callable[[StepReport], None] | None = None) -> list[StepReport]:
        reports = []
        if self.step == 0:
            initial = run_initial_evaluation(self._phases, self.plan)
            if initial is not None:
                reports.append(StepReport(0, initial, ("evaluate", "log_evaluation")))
                if on_step is not None:
                    on_step(reports[-1])
        if self.config.disaggregated and self.step < self.plan.total_steps:
            self._phases.continue_produce(self.step)  # the producer starts with the weights the run starts from
        while self.step < self.plan.total_steps:
            reports.append(self.train_step())
            if on_step is not None:
                on_step(reports[-1])
        if self.config.disaggregated:
            self._phases.pause_produce(self.step)
        return reports

    def hand_accelerator_to(self, role: str) -> None:
        """The colocated switch: the other side offloads first (both calls do nothing on CPU, and
        nothing when the side already holds the accelerator)."""
        if self.worker is None or self.backend is None or self.config.disaggregated:
            return
        if role == "rollout":
            self.worker.offload()
            self.backend.onload()
        else:
            self.backend.offload()
            self.worker.onload()

    def close(self) -> None:
        self.controller.close()
        if self.trackers is not None:
            self.trackers.close()

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalPhases:
    """The phases of ``engine.run.step`` as plain calls on a ``LocalRun``'s objects."""

    def __init__(self, run: LocalRun) -> None:
        self._run = run
        self._config = run.config

    def produce_batch(self, step: int) -> Batch:
        self._run.hand_accelerator_to("rollout")
        produced = self._run.controller.produce_batch(step, self._run.backend)
        return Batch(produce_summary(produced), produced, produced.launched_s)

    def start_rollout(self, step: int) -> None:
        """Nothing runs beside it here: the rollout is produced now and collected by ``produce_batch``."""
        self._run.hand_accelerator_to("rollout")
        self._run.controller.produce_batch(step, self._run.backend)

    def load_batch(self, step: int) -> Batch:
        produced = self._run.controller.load_batch(step)
        return Batch(produce_summary(produced), produced, produced.launched_s)

    def write_trajectories(self, step: int, batch: Batch) -> Done[str]:
        uri, _ = self._run.controller.write_trajectories(batch.samples.groups, step, "train", ledger=batch.samples.ledger)
        return Done(uri)

    def prepare_data(self, step: int, batch: Batch) -> Prepared:
        prepared = self._run.controller.prepare_data(batch.samples.groups, step)
        return Prepared(prepared.info, prepared)

    def fit(self, step: int, prepared: Prepared) -> dict[str, float]:
        self._run.hand_accelerator_to("trainer")
        return self._run.worker.fit(prepared.sequences, step).metrics

    def save_checkpoint(self, step: int) -> str:
        uri = begin_checkpoint(self._config, step)
        save_optimizer = not self._config.checkpoint_no_save_optimizer
        self._run.worker.save_checkpoint(uri, self._config.storage_options, save_optimizer=save_optimizer)
        self._run.controller.save_checkpoint(uri)
        return uri

    def export_hf(self, step: int) -> str:
        uri = begin_hf_export(self._config, step)
        self._run.worker.export_hf(uri, self._config.storage_options, self._config.tokenizer_source)
        seal_hf_export(self._config, step)
        return uri

    def sync_weights(self, step: int) -> None:
        """Weights go to the rollout engine while its KV cache sleeps, with no disk round trip."""
        self._run.backend.load_weights(self._run.worker.export_weights(), policy_version=step)

    def evaluate(self, step: int) -> Evaluation:
        self._run.hand_accelerator_to("rollout")
        groups, metrics = self._run.controller.evaluate(step, self._run.backend)
        uri = self._run.controller.write_trajectories(groups, step, "eval")[0] if self._run.plan.keeps_records else ""
        return Evaluation(uri, metrics)

    def log_step(self, step: int, record: StepRecord) -> Logged:
        metrics, counters = assemble_step_metrics(record, self._run.plan.devices)
        if self._run.trackers is not None:
            self._run.trackers.log(metrics, step)
            record_step(self._config, step, metrics)
        return Logged(metrics, counters)

    def commit_checkpoint(self, step: int, counters: RunCounters) -> str:
        seal_checkpoint(self._config, step, train_state(step, counters))
        return f"{self._config.checkpoint_uri}/{step_name(step)}"

    def log_evaluation(self, step: int, evaluation: Evaluation) -> dict[str, float]:
        metrics = {f"eval/{k}": v for k, v in evaluation.metrics.items()}
        if self._run.trackers is not None:
            self._run.trackers.log(metrics, step)
        return metrics

    # -- disaggregated: the producer runs on a thread of this process ------------------------------

    def get_batch(self, step: int) -> Batch:
        taken = self._run.controller.producer.get_batch(step, self._config.cluster.ray_get_timeout_s)
        if taken is None:
            raise TimeoutError(f"No batch for step {step} within {self._config.cluster.ray_get_timeout_s:g}s.")
        return Batch(*taken.as_produced())

    def pause_produce(self, step: int) -> float:
        return self._run.controller.producer.pause_produce(self._config.cluster.ray_get_timeout_s)

    def continue_produce(self, step: int) -> None:
        self._run.controller.producer.continue_produce(step, self._run.backend)
