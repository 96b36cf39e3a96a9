"""Trackers that keep a run's metrics in a service users already browse: Weights & Biases and MLflow.

Both are optional packages, imported only when ``exp_tracker`` names them. A resumed or rolled-back run
goes on in the same tracker run: its ids are kept in ``{run}/logs/trackers.json``, and a fresh start
(step 1) makes new ones. Steps logged again after a resume or a rollback keep their later values:
W&B plots against the trellis step (``trellis/step``), MLflow keeps both values in a metric's history.
``metrics.jsonl`` stays the complete record.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from typing import Any, Iterator, Mapping

from trellis.engine.config.trackers import MlflowConfig, WandbConfig
from trellis.engine.errors import SettingError
from trellis.engine.storage.store import Store

log = logging.getLogger(__name__)

STEP_KEY = "trellis/step"  # the x-axis of every W&B chart: W&B's own step only grows
_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. :/]")  # what MLflow refuses in a metric or param name


class TrackerIds:
    """``{run}/logs/trackers.json``: each tracker's run id, so that a resume goes on in the same run."""

    def __init__(self, logs: Store, first_step: int) -> None:
        self._target = logs.join("trackers.json")
        self._ids: dict[str, str] = {}
        if first_step > 1 and self._target.exists():
            with self._target.open("r") as handle:
                self._ids = json.load(handle)

    def get(self, tracker: str) -> str | None:
        return self._ids.get(tracker)

    def keep(self, tracker: str, run_id: str) -> None:
        self._ids[tracker] = run_id
        with self._target.open("w") as handle:
            json.dump(self._ids, handle, indent=1)


def _needs(package: str, tracker: str) -> Any:
    try:
        return __import__(package)
    except ImportError as error:
        raise SettingError(
            f"exp_tracker names {tracker}, but the {package} package is not installed where the run's controller "
            f"runs ({error}): pip install {package} there, or drop {tracker} from exp_tracker"
        ) from error


class WandbTracker:
    """One W&B run per trellis run; offline (files under ``dir``, ``wandb sync`` later) by default."""

    def __init__(self, settings: WandbConfig, ids: TrackerIds, *, name: str, directory: str, config: Mapping[str, Any]) -> None:
        wandb = _needs("wandb", "wandb")
        os.makedirs(directory, exist_ok=True)
        run_id = ids.get("wandb") or uuid.uuid4().hex[:8]
        self._run = wandb.init(
            project=settings.project, entity=settings.entity, name=name, id=run_id, resume="allow", mode=settings.mode,
            dir=directory, config=dict(config), tags=settings.tags, settings=wandb.Settings(console="off", silent=True),
        )
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)
        ids.keep("wandb", run_id)

    @property
    def directory(self) -> str:
        """Where this run's W&B files are (``wandb sync`` it)."""
        return os.path.dirname(self._run.dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log({**metrics, STEP_KEY: step})

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """One MLflow run per trellis run, in ``settings.experiment`` (made if missing), tagged with the run's
    URI; the settings as params (secrets masked), every step's metrics in one batch."""

    def __init__(self, settings: MlflowConfig, ids: TrackerIds, *, name: str, run_uri: str, first_step: int,
                 config: Mapping[str, Any]) -> None:
        _needs("mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(tracking_uri=settings.tracking_uri)
        try:
            experiment = self._client.get_experiment_by_name(settings.experiment)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(settings.experiment)
            self.run_id = ids.get("mlflow")
            if self.run_id is None:
                run = self._client.create_run(experiment_id, run_name=name, tags={"trellis.run_uri": run_uri})
                self.run_id = run.info.run_id
                if settings.log_params:
                    params = [Param(_mlflow_key(k), str(v)[:6000]) for k, v in _flattened(config)]
                    for chunk in _chunks(params, 100):
                        self._client.log_batch(self.run_id, params=chunk)
            else:
                self._client.update_run(self.run_id, status="RUNNING")
                self._client.set_tag(self.run_id, "trellis.resumed_at_step", str(first_step))
        except Exception as error:  # the service is the user's: name it, and what to change
            raise SettingError(
                f"MLflow at {self._client.tracking_uri} refused the run ({type(error).__name__}: {error}); check "
                "trackers.mlflow.tracking_uri (or MLFLOW_TRACKING_URI) and that the server is up"
            ) from error
        ids.keep("mlflow", self.run_id)
        self._failed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        stamp = int(time.time() * 1000)
        batch = [self._metric(_mlflow_key(k), float(v), stamp, step) for k, v in metrics.items()]
        try:
            for chunk in _chunks(batch, 1000):
                self._client.log_batch(self.run_id, metrics=chunk)
        except Exception as error:  # a tracker outage must not end training; metrics.jsonl has every step
            if not self._failed:
                log.warning("MLflow did not take step %d's metrics (%s); metrics.jsonl keeps them", step, error)
            self._failed = True

    def close(self) -> None:
        try:
            self._client.set_terminated(self.run_id, "FINISHED")
        except Exception as error:
            log.warning("MLflow run %s not marked finished: %s", self.run_id, error)


def _mlflow_key(name: str) -> str:
    return _MLFLOW_KEY.sub("_", name)[:250]


def _flattened(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            yield from _flattened(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
