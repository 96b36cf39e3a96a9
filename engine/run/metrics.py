"""A step's metrics under the reference's names: phase timers, the run-level counters and the seven
``throughput/*``, per device of the side that did the work."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, Field

from trellis.engine.run.goodput import ROLLED_BACK_S, goodput_metrics


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Adds the block's wall time to ``timings[name]`` (the ``time/{name}`` metric)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - started


class RunCounters(BaseModel):
    """The run-level counters behind ``throughput/e2e_*``. They travel from step to step (and into
    checkpoints, so a resumed run continues them); ``started_s`` is wall-clock time (``time.time()``),
    so the counters mean the same in every process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    started_s: float
    samples: float = 0.0
    tokens: float = 0.0
    rolled_back_device_s: float = 0.0  # spent on steps the stability guard set aside, not logged yet (goodput)

    @classmethod
    def fresh(cls) -> RunCounters:
        return cls(started_s=time.time())

    @classmethod
    def resumed(cls, train_state: Mapping[str, Any] | None) -> RunCounters:
        """Counters that continue those a checkpoint's ``train_state.json`` recorded (fresh without one)."""
        if train_state is None:
            return cls.fresh()
        return cls(
            started_s=time.time() - float(train_state["elapsed_s"]),
            samples=float(train_state["samples"]),
            tokens=float(train_state["tokens"]),
        )

    def after(self, *, samples: float, tokens: float) -> RunCounters:
        return self.model_copy(update={"samples": self.samples + samples, "tokens": self.tokens + tokens, "rolled_back_device_s": 0.0})


class SideDevices(BaseModel):
    """One side of a run (trainer ranks, or rollout workers) as the per-device ``throughput/*`` count
    it: its workers and the devices each holds. On GPUs a device is a GPU (a colocated worker counts
    the GPU it shares with the other side's worker); on CPU it is the worker's process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = Field(ge=1)
    devices_per_worker: float = Field(gt=0.0)

    @property
    def devices(self) -> int:
        """Whole devices: workers that hold parts of one GPU (0.5 each) count it once."""
        return max(1, math.ceil(self.workers * self.devices_per_worker - 1e-9))


class RunDevices(BaseModel):
    """What each side's ``throughput/*`` divide by (the run plan resolves it once)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train: SideDevices
    rollout: SideDevices


def throughput_metrics(
    counters: RunCounters,
    *,
    training_samples: float,
    training_tokens: float,
    step_s: float,
    fit_s: float,
    produce_s: float,
    produced_samples: float,
    produced_tokens: float,
    now_s: float,
    devices: RunDevices,
) -> dict[str, float]:
    """sgs / tgs = samples / tokens per second per device, as XTuner's: the trained figures over the
    trainer's devices, the rollout ones over the rollout's. ``counters`` already include this step's
    training samples and tokens."""
    e2e_s = max(now_s - counters.started_s, 1e-9)
    train, rollout = float(devices.train.devices), float(devices.rollout.devices)
    return {
        "throughput/e2e_effective_sgs": counters.samples / e2e_s / train,
        "throughput/e2e_effective_tgs": counters.tokens / e2e_s / train,
        "throughput/effective_sgs": training_samples / max(step_s, 1e-9) / train,
        "throughput/effective_tgs": training_tokens / max(step_s, 1e-9) / train,
        "throughput/training_tgs": training_tokens / max(fit_s, 1e-9) / train,
        "throughput/rollout_sgs": produced_samples / produce_s / rollout if produce_s > 0 else 0.0,
        "throughput/rollout_tgs": produced_tokens / produce_s / rollout if produce_s > 0 else 0.0,
    }


@dataclass(frozen=True)
class StepRecord:
    """Everything ``log_step`` turns into the step's metrics."""

    timings: dict[str, float]  # seconds by phase name, and ``step``
    produce: dict[str, float]  # the produced batch's summary
    data_info: dict[str, float]  # response/* statistics, training sample and token counts
    fit_metrics: dict[str, float]
    eval_metrics: dict[str, float]
    counters: RunCounters  # before this step
    links: dict[str, str] = field(default_factory=dict)  # for Prefect artifacts: trajectories, HF export...
    phase_metrics: dict[str, float] = field(default_factory=dict)  # named in full by their phase (weights/*)


def update_metrics(produce: dict[str, float], data_info: dict[str, float], fit_metrics: dict[str, float]) -> dict[str, float]:
    """The step's metrics known once its update is applied, named as the logged step names them: what the
    stability guard (``engine.run.guard``) judges."""
    metrics = {f"response/{k}": v for k, v in data_info.items()}
    for key, value in fit_metrics.items():
        metrics[key if "/" in key else f"train/{key}"] = value
    if "entropy" in fit_metrics:
        metrics["entropy/train"] = fit_metrics["entropy"]
    metrics.update({k: v for k, v in produce.items() if k.startswith(("trajectory/", "async/", "timing/", "sampling/", "agent/"))})
    return metrics


def assemble_step_metrics(
    record: StepRecord, devices: RunDevices, now_s: float | None = None, *, shared_devices: bool = True
) -> tuple[dict[str, float], RunCounters]:
    """All metrics of one step under the reference's names (``time/``, ``response/``, ``throughput/``...),
    and the run counters with this step added. The rollout's own counts are logged too
    (``rollout/produced_*``, ``time/rollout_window``: the wall time of its generation, which may have
    started in the previous step), so that the per-device rollout figures can be checked."""
    timings, produce, data_info = record.timings, record.produce, record.data_info
    fit_metrics, eval_metrics = record.fit_metrics, record.eval_metrics
    counters = record.counters.after(samples=data_info["training_samples"], tokens=data_info["training_tokens"])
    metrics = {f"time/{k}": v for k, v in timings.items()}
    metrics.update(update_metrics(produce, data_info, fit_metrics))
    metrics.update({f"eval/{k}": v for k, v in eval_metrics.items()})
    metrics.update(record.phase_metrics)
    if record.counters.rolled_back_device_s:
        metrics[ROLLED_BACK_S] = record.counters.rolled_back_device_s
    # The rollout's own wall time (generating and scoring), also when it ran before the step that trained
    # it (launched early, or by the asynchronous producer): time/produce_batch only counts the wait for it.
    metrics["time/rollout"] = produce["produce_time_s"]
    metrics["rollout/failed_samples"] = produce["failed_samples"]
    metrics["rollout/policy_version"] = produce["policy_version"]
    metrics["rollout/produced_samples"] = produce["produced_samples"]
    metrics["rollout/produced_tokens"] = produce["produced_tokens"]
    metrics["time/rollout_window"] = produce["produce_time_s"]
    metrics.update(
        throughput_metrics(
            counters,
            training_samples=data_info["training_samples"],
            training_tokens=data_info["training_tokens"],
            step_s=timings["step"],
            fit_s=timings.get("fit", 0.0),
            produce_s=produce["produce_time_s"],
            produced_samples=produce["produced_samples"],
            produced_tokens=produce["produced_tokens"],
            now_s=time.time() if now_s is None else now_s,
            devices=devices,
        )
    )
    metrics.update(goodput_metrics(metrics, devices, shared=shared_devices))
    return metrics, counters
