"""Where a run's metrics go: ``metrics.jsonl`` (always), TensorBoard events through fsspec, and the hosted
trackers ``exp_tracker`` names (``engine.storage.hosted_trackers``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Protocol

from fsspec.implementations.local import LocalFileSystem

from trellis.engine.config import TrellisConfig
from trellis.engine.storage.json_lines import whole_lines
from trellis.engine.storage.store import Store


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlTracker:
    """One JSON object per step in ``metrics.jsonl`` (any fsspec URI); flushed every step."""

    def __init__(self, target: Store) -> None:
        self._target = target
        fs, path = target.fs()
        fs.makedirs(fs._parent(path), exist_ok=True)
        self._lines: list[tuple[int, str]] = []  # (step, its line): each line is parsed once, at start
        if target.exists():
            with target.open("r") as handle:
                records = whole_lines(handle.read(), source=target.uri)
            self._lines = [(record["step"], json.dumps(record, sort_keys=True)) for record in records]

    def log(self, metrics: dict[str, float], step: int) -> None:
        # Rewritten whole: object stores have no append, and a resumed run drops lines past its step.
        self._lines = [(logged, line) for logged, line in self._lines if logged < step]
        self._lines.append((step, json.dumps({"step": step, **metrics}, sort_keys=True)))
        self._target.replace_text("".join(line + "\n" for _, line in self._lines))  # a crash half-way keeps the previous steps' lines

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
        log_dir: Store,
        purge_step: int | None = None,
        upload_every_s: float = 30.0,
    ) -> None:
        """``purge_step``: a resumed run hides the events it is about to write again."""
        from torch.utils.tensorboard import (
            SummaryWriter,  # needs the tensorboard package
        )

        self._fs, self._path = log_dir.fs()
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


class Trackers:
    """Every tracker of a run, built the same way by both runners: ``metrics.jsonl`` always, and each
    tracker ``exp_tracker`` names. Built once per run start: a resumed run (``first_step`` > 1) drops
    what it is about to write again (TensorBoard, metrics.jsonl) or goes on in the same run (W&B, MLflow)."""

    def __init__(self, config: TrellisConfig, first_step: int) -> None:
        logs = Store(config.run_uri, config.storage_options).join("logs")
        self._trackers: list[Tracker] = [JsonlTracker(logs.join("metrics.jsonl"))]
        try:
            self._open_named(config, logs, first_step)
        except BaseException:
            self.close()
            raise

    def _open_named(self, config: TrellisConfig, logs: Store, first_step: int) -> None:
        names = config.exp_tracker
        if "tensorboard" in names:
            purge = first_step if first_step > 1 else None
            self._trackers.append(TensorboardTracker(logs.join("tensorboard"), purge))
        if "wandb" not in names and "mlflow" not in names:
            return
        from trellis.engine.secrets import redact_settings
        from trellis.engine.storage.hosted_trackers import MlflowTracker, TrackerIds, WandbTracker

        ids, settings = TrackerIds(logs, first_step), redact_settings(config)
        if "wandb" in names:
            fs, path = logs.fs()
            local_logs = path if isinstance(fs, LocalFileSystem) else os.path.abspath("wandb")
            self._trackers.append(WandbTracker(
                config.trackers.wandb, ids, name=config.experiment_name,
                directory=config.trackers.wandb.dir or local_logs, config=settings,
            ))
        if "mlflow" in names:
            self._trackers.append(MlflowTracker(
                config.trackers.mlflow, ids, name=config.experiment_name, run_uri=config.run_uri,
                first_step=first_step, config=settings,
            ))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tracker in self._trackers:
            tracker.log(metrics, step)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()
