"""The whole RL loop in one process: no Prefect, no Ray. For notebooks, scripts, tests and benchmarks.

The orchestrated flow runs the same phases, in the same order, with the same names.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Callable

import torch

from engine.checkpoint import require_complete
from engine.config import TrellisConfig
from engine.controller import Controller
from engine.lake import LakeError, stored_steps
from engine.metrics import JsonlTracker, assemble_step_metrics, timer
from engine.preflight import check_inputs
from engine.produce import ProduceResult, produce_summary
from engine.resume import (
    StartPlan,
    begin_checkpoint,
    begin_hf_export,
    meter_from,
    plan_start,
    seal_checkpoint,
    seal_hf_export,
    train_state,
)
from engine.rollout.base import RolloutBackend
from engine.rollout.transformers_backend import TransformersRollout
from engine.secrets import install_log_redaction, write_runtime_environment
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
    if config.debug_train:  # replay every stored batch
        assert config.debug_rollout_dir is not None
        steps = stored_steps(config.debug_rollout_dir, "train", config.storage_options)
        if not steps:
            raise LakeError(
                f"debug_train found no stored batches under {config.debug_rollout_dir}/trajectories/split=train; "
                "point debug_rollout_dir at a run folder (or a debug_rollout output)."
            )
        return max(steps)
    assert config.total_epochs is not None  # the config validator guarantees one of the two
    return max(1, dataset_size // config.train_batch_size * config.total_epochs)


def rollout_device(config: TrellisConfig) -> torch.device:
    """vLLM runs on the GPU; the transformers loop on the trainer's device."""
    if config.rollout.backend == "vllm":
        return torch.device("cuda")
    return resolve_device(config.train_worker.device)


def build_rollout_backend(config: TrellisConfig, tokenizer) -> RolloutBackend:
    """vLLM when configured (GPU only); otherwise the transformers loop on the trainer's device,
    bf16 on GPU, fp32 on CPU."""
    rollout = config.rollout
    if rollout.backend == "vllm":
        from engine.rollout.vllm_backend import VllmRollout  # vLLM is an optional extra

        longest = config.train_dataset.max_prompt_length + rollout.max_new_tokens
        return VllmRollout(
            config.load_from,
            tokenizer,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_model_len=longest,
            sleep_level=rollout.sleep_level,
            seed=config.seed,
        )
    device = rollout_device(config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return TransformersRollout(config.load_from, tokenizer, device=str(device), dtype=dtype, seed=config.seed)


@dataclass
class StepReport:
    step: int
    metrics: dict[str, float]


class LocalRun:
    """Builds every engine part from a config and runs RL steps in-process.

    With ``track`` (the default) it writes what the flow writes: metrics.jsonl, env.json, the
    trajectories as Parquet, checkpoints and HF exports; benchmarks turn it off to time the engine
    alone. ``resume`` continues from the latest complete checkpoint (as ``auto_resume`` does).
    """

    def __init__(self, config: TrellisConfig, *, track: bool = True, resume: bool = False) -> None:
        check_inputs(config)
        self.config = config
        install_log_redaction(config.storage_options)
        seed_everything(config.seed, config.deterministic)
        self.controller = Controller(config)
        self.train_report = self.controller.train_report
        self.total_train_steps = resolve_total_steps(config, self.controller.dataset_size)
        self.backend = None if config.debug_train else build_rollout_backend(config, self.controller.tokenizer)
        self.worker = None
        if not config.debug_rollout:
            self.worker = TrainingWorker(
                config, total_train_steps=self.total_train_steps, pad_token_id=self.controller.pad_token_id
            )
        self.track = track
        self.tracker = JsonlTracker(f"{config.run_uri}/logs/metrics.jsonl", config.storage_options) if track else None
        if track:
            write_runtime_environment(config.run_uri, config.storage_options)
        self.step = 0
        self.throughput = meter_from(None)
        self.plan = plan_start(config, resume=resume) if track else StartPlan("fresh", 0)
        if self.plan.checkpoint is not None:
            self._restore(self.plan.checkpoint)

    def _restore(self, uri: str) -> None:
        load = self.config.load_checkpoint_cfg
        state = require_complete(uri, self.config.storage_options)
        if self.worker is not None:
            self.worker.load_checkpoint(uri, self.config.storage_options, load_optimizer=load.load_optimizer_states)
            if self.backend is not None:
                self.backend.load_weights(self.worker.export_weights(), policy_version=int(state["policy_version"]))
        self.controller.load_checkpoint(uri, load_dataset=load.load_dataset)
        self.step = int(state["step"])
        self.throughput = meter_from(state)
        logger.info("Resumed from %s at step %d", uri, self.step)

    def produce_batch(self, step: int) -> ProduceResult:
        if self.config.debug_train:
            return self.controller.load_batch(step)
        return self.controller.produce_batch(step, self.backend)

    def sync_weights(self, step: int) -> None:
        """Weights go to the rollout engine while its KV cache sleeps, with no disk round trip."""
        self.backend.load_weights(self.worker.export_weights(), policy_version=step)

    def hand_accelerator_to(self, role: str) -> None:
        """The colocated switch: the other side offloads first (both calls do nothing on CPU, and
        nothing when the side already holds the accelerator)."""
        if self.worker is None or self.backend is None:
            return
        if role == "rollout":
            self.worker.offload()
            self.backend.onload()
        else:
            self.backend.offload()
            self.worker.onload()

    def evaluate(self, step: int) -> dict[str, float]:
        groups, metrics = self.controller.evaluate(step, self.backend)
        if self.track:
            self.controller.write_trajectories(groups, step, "eval")
        return metrics

    def train_step(self) -> StepReport:
        step = self.step + 1
        config = self.config
        timings: dict[str, float] = {"fit": 0.0}
        eval_metrics: dict[str, float] = {}
        fit_metrics: dict[str, float] = {}
        with timer("step", timings):
            with timer("switch_to_rollout", timings):
                self.hand_accelerator_to("rollout")
            with timer("produce_batch", timings):
                produced = self.produce_batch(step)
            with timer("prepare_data", timings):
                batch = self.controller.prepare_data(produced.groups, step)
            if self.worker is not None:
                with timer("switch_to_trainer", timings):
                    self.hand_accelerator_to("trainer")
                with timer("fit", timings):
                    fit_metrics = self.worker.fit(batch, step).metrics
            if self.track and config.hf_due(step, self.total_train_steps):
                with timer("save_hf", timings):
                    self._export_hf(step)
            synced = step % config.sync_weights_interval == 0 and self.backend is not None and self.worker is not None
            if synced:
                with timer("sync_weights", timings):
                    self.sync_weights(step)
                with timer("switch_to_rollout", timings):  # the next produce_batch finds it done
                    self.hand_accelerator_to("rollout")
            if synced and config.enable_evaluate and step % config.evaluate_step == 0:
                with timer("evaluate", timings):
                    eval_metrics = self.evaluate(step)
        self.step = step
        metrics = self._step_metrics(produced, batch.info, fit_metrics, eval_metrics, timings)
        if self.track:
            if not config.debug_train:
                self.controller.write_trajectories(produced.groups, step, "train")
            self.tracker.log(metrics, step)
            if config.checkpoint_due(step, self.total_train_steps):
                self._save_checkpoint(step)
        return StepReport(step, metrics)

    def run(self, on_step: Callable[[StepReport], None] | None = None) -> list[StepReport]:
        reports = []
        initial = self.config.enable_initial_evaluate and self.backend is not None and self.worker is not None
        if initial and self.step == 0:
            metrics = {f"eval/{k}": v for k, v in self.evaluate(0).items()}
            if self.tracker is not None:
                self.tracker.log(metrics, 0)
            reports.append(StepReport(0, metrics))
        while self.step < self.total_train_steps:
            report = self.train_step()
            reports.append(report)
            if on_step is not None:
                on_step(report)
        return reports

    def _save_checkpoint(self, step: int) -> None:
        config = self.config
        uri = begin_checkpoint(config, step)
        if self.worker is not None:
            self.worker.save_checkpoint(uri, config.storage_options, save_optimizer=not config.checkpoint_no_save_optimizer)
        self.controller.save_checkpoint(uri)
        version = self.backend.policy_version if self.backend is not None else step
        seal_checkpoint(config, step, train_state(step, self.throughput, policy_version=version))

    def _export_hf(self, step: int) -> None:
        uri = begin_hf_export(self.config, step)
        self.worker.export_hf(uri, self.config.storage_options, self.config.tokenizer_source)
        seal_hf_export(self.config, step)

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
