"""The whole RL loop in one process: no Prefect, no Ray. For notebooks, scripts, tests and benchmarks.

The orchestrated flow runs the same phases, in the same order, with the same names.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.config import TrellisConfig
from engine.controller import Controller
from engine.metrics import JsonlTracker, ThroughputMeter, assemble_step_metrics, timer
from engine.preflight import check_inputs
from engine.produce import ProduceResult, produce_summary
from engine.rollout.transformers_backend import TransformersRollout
from engine.train_worker import TrainingWorker, resolve_device

logger = logging.getLogger(__name__)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def resolve_total_steps(config: TrellisConfig, dataset_size: int) -> int:
    if config.total_train_steps is not None:
        return config.total_train_steps
    assert config.total_epochs is not None  # the config validator guarantees one of the two
    return max(1, dataset_size // config.train_batch_size * config.total_epochs)


def build_rollout_backend(config: TrellisConfig, tokenizer) -> TransformersRollout:
    """The rollout backend on the trainer's device: bf16 on GPU, fp32 on CPU."""
    device = resolve_device(config.train_worker.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return TransformersRollout(config.load_from, tokenizer, device=str(device), dtype=dtype, seed=config.seed)


@dataclass
class StepReport:
    step: int
    metrics: dict[str, float]


class LocalRun:
    """Builds every engine part from a config and runs RL steps in-process.

    With ``track`` (the default) it writes what the flow writes: metrics.jsonl and the train
    trajectories as Parquet; benchmarks turn it off to time the engine alone.
    """

    def __init__(self, config: TrellisConfig, *, track: bool = True) -> None:
        check_inputs(config)
        self.config = config
        seed_everything(config.seed, config.deterministic)
        self.controller = Controller(config)
        self.train_report = self.controller.train_report
        self.total_train_steps = resolve_total_steps(config, self.controller.dataset_size)
        self.backend = build_rollout_backend(config, self.controller.tokenizer)
        self.worker = TrainingWorker(
            config, total_train_steps=self.total_train_steps, pad_token_id=self.controller.pad_token_id
        )
        self.tracker = JsonlTracker(f"{config.run_uri}/logs/metrics.jsonl", config.storage_options) if track else None
        self.throughput = ThroughputMeter(started_s=time.time())
        self.step = 0

    def produce_batch(self, step: int) -> ProduceResult:
        return self.controller.produce_batch(step, self.backend)

    def sync_weights(self, step: int) -> None:
        self.backend.load_weights(self.worker.export_weights(), policy_version=step)

    def evaluate(self, step: int) -> dict[str, float]:
        return self.controller.evaluate(step, self.backend)[1]

    def train_step(self) -> StepReport:
        step = self.step + 1
        config = self.config
        timings: dict[str, float] = {}
        with timer("step", timings):
            with timer("produce_batch", timings):
                produced = self.produce_batch(step)
            with timer("prepare_data", timings):
                batch = self.controller.prepare_data(produced.groups, step)
            with timer("fit", timings):
                fit = self.worker.fit(batch, step)
            synced = step % config.sync_weights_interval == 0
            if synced:
                with timer("sync_weights", timings):
                    self.sync_weights(step)
            eval_metrics: dict[str, float] = {}
            if synced and config.enable_evaluate and step % config.evaluate_step == 0:
                with timer("evaluate", timings):
                    eval_metrics = self.evaluate(step)
        self.step = step
        metrics = self._step_metrics(produced, batch.info, fit.metrics, eval_metrics, timings)
        if self.tracker is not None:
            self.controller.write_trajectories(produced.groups, step, "train")
            self.tracker.log(metrics, step)
        return StepReport(step, metrics)

    def run(self, on_step: Callable[[StepReport], None] | None = None) -> list[StepReport]:
        reports = []
        if self.config.enable_initial_evaluate:
            initial = {f"eval/{k}": v for k, v in self.evaluate(0).items()}
            if self.tracker is not None:
                self.tracker.log(initial, 0)
            reports.append(StepReport(0, initial))
        while self.step < self.total_train_steps:
            report = self.train_step()
            reports.append(report)
            if on_step is not None:
                on_step(report)
        return reports

    def close(self) -> None:
        self.controller.close()
        if self.tracker is not None:
            self.tracker.close()

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _step_metrics(self, produced, data_info, fit_metrics, eval_metrics, timings) -> dict[str, float]:
        return assemble_step_metrics(
            timings=timings,
            produce=produce_summary(produced),
            data_info=data_info,
            fit_metrics=fit_metrics,
            eval_metrics=eval_metrics,
            meter=self.throughput,
        )
