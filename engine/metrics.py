"""Throughput metrics (the reference's seven ``throughput/*``), phase timers and metric trackers."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import fsspec
from fsspec.implementations.local import LocalFileSystem


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Adds the block's wall time to ``timings[name]`` (the ``time/{name}`` metric)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - started


@dataclass
class ThroughputMeter:
    """Run-level counters behind ``throughput/e2e_*``; per-step figures come from the step's own numbers.

    sgs / tgs = samples / tokens per second per worker (GPU, or process on CPU). ``started_s`` is
    wall-clock time (``time.time()``), so the meter can travel between processes.
    """

    started_s: float
    train_workers: int = 1
    rollout_workers: int = 1
    samples: float = 0.0
    tokens: float = 0.0

    def clock(self) -> dict[str, float]:
        """The run-level counters as plain numbers, to travel between flow runs and tasks."""
        return {"started_s": self.started_s, "samples": self.samples, "tokens": self.tokens}

    @classmethod
    def from_clock(cls, clock: dict[str, float]) -> ThroughputMeter:
        return cls(started_s=clock["started_s"], samples=clock["samples"], tokens=clock["tokens"])

    def step_metrics(
        self,
        *,
        training_samples: float,
        training_tokens: float,
        step_s: float,
        fit_s: float,
        produce_s: float,
        produced_samples: float,
        produced_tokens: float,
        now_s: float | None = None,
    ) -> dict[str, float]:
        self.samples += training_samples
        self.tokens += training_tokens
        e2e_s = (now_s if now_s is not None else time.time()) - self.started_s
        train, rollout = float(self.train_workers), float(self.rollout_workers)
        return {
            "throughput/e2e_effective_sgs": self.samples / max(e2e_s, 1e-9) / train,
            "throughput/e2e_effective_tgs": self.tokens / max(e2e_s, 1e-9) / train,
            "throughput/effective_sgs": training_samples / max(step_s, 1e-9) / train,
            "throughput/effective_tgs": training_tokens / max(step_s, 1e-9) / train,
            "throughput/training_tgs": training_tokens / max(fit_s, 1e-9) / train,
            "throughput/rollout_sgs": produced_samples / produce_s / rollout if produce_s > 0 else 0.0,
            "throughput/rollout_tgs": produced_tokens / produce_s / rollout if produce_s > 0 else 0.0,
        }


def assemble_step_metrics(
    *,
    timings: dict[str, float],
    produce: dict[str, float],
    data_info: dict[str, float],
    fit_metrics: dict[str, float],
    eval_metrics: dict[str, float],
    meter: ThroughputMeter,
    now_s: float | None = None,
) -> dict[str, float]:
    """All metrics of one step under the reference's names (``time/``, ``response/``, ``throughput/``...)."""
    metrics = {f"time/{k}": v for k, v in timings.items()}
    metrics.update({f"response/{k}": v for k, v in data_info.items()})
    for key, value in fit_metrics.items():
        metrics[key if "/" in key else f"train/{key}"] = value
    if "entropy" in fit_metrics:
        metrics["entropy/train"] = fit_metrics["entropy"]
    metrics.update({f"eval/{k}": v for k, v in eval_metrics.items()})
    metrics.update({k: v for k, v in produce.items() if k.startswith("trajectory/")})
    metrics["rollout/failed_samples"] = produce["failed_samples"]
    metrics["rollout/policy_version"] = produce["policy_version"]
    metrics.update(
        meter.step_metrics(
            training_samples=data_info["training_samples"],
            training_tokens=data_info["training_tokens"],
            step_s=timings["step"],
            fit_s=timings["fit"],
            produce_s=produce["produce_time_s"],
            produced_samples=produce["produced_samples"],
            produced_tokens=produce["produced_tokens"],
            now_s=now_s,
        )
    )
    return metrics


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlTracker:
    """One JSON object per step in ``metrics.jsonl`` (any fsspec URI); flushed every step."""

    def __init__(self, uri: str, storage_options: dict[str, str] | None = None) -> None:
        self._uri = uri
        self._fs, self._path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        self._fs.makedirs(self._fs._parent(self._path), exist_ok=True)
        self._lines: list[str] = []
        if self._fs.exists(self._path):
            with self._fs.open(self._path, "r") as handle:
                self._lines = handle.read().splitlines()

    def log(self, metrics: dict[str, float], step: int) -> None:
        # Rewritten whole: object stores have no append, and a resumed run drops lines past its step.
        self._lines = [line for line in self._lines if json.loads(line)["step"] < step]
        self._lines.append(json.dumps({"step": step, **metrics}, sort_keys=True))
        with self._fs.open(self._path, "w") as handle:
            handle.write("\n".join(self._lines) + "\n")

    def close(self) -> None:
        """Every line is already written."""


class TensorboardTracker:
    """TensorBoard event files under ``log_dir`` (any fsspec URI).

    TensorBoard's writer only knows local paths (and its own S3 client, which ignores
    ``storage_options``), so for a remote ``log_dir`` it writes to a local staging folder that is
    uploaded every ``upload_every_s`` seconds and on ``close``; metrics.jsonl stays the complete record.
    """

    def __init__(
        self,
        log_dir: str,
        purge_step: int | None = None,
        storage_options: dict[str, Any] | None = None,
        upload_every_s: float = 30.0,
    ) -> None:
        """``purge_step``: a resumed run hides the events it is about to write again."""
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._fs, self._path = fsspec.core.url_to_fs(log_dir, **(storage_options or {}))
        self._remote = not isinstance(self._fs, LocalFileSystem)
        self._local = tempfile.mkdtemp(prefix="trellis-tensorboard-") if self._remote else self._path
        self._writer = SummaryWriter(log_dir=self._local, purge_step=purge_step)
        self._upload_every_s = upload_every_s
        self._uploaded_s = time.monotonic()

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()
        if self._remote and time.monotonic() - self._uploaded_s >= self._upload_every_s:
            self._upload()

    def close(self) -> None:
        self._writer.close()
        if self._remote:
            self._upload()
            shutil.rmtree(self._local, ignore_errors=True)

    def _upload(self) -> None:
        self._fs.makedirs(self._path, exist_ok=True)
        for name in os.listdir(self._local):
            self._fs.put_file(os.path.join(self._local, name), f"{self._path}/{name}")
        self._uploaded_s = time.monotonic()
