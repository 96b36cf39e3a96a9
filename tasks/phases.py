"""The phases of ``engine.run.step`` as Prefect tasks: inside a step's flow run, every phase is a named
task run (``fit[step=12]``), and ``write_trajectories`` runs beside ``prepare_data`` and ``fit``."""

from __future__ import annotations

from prefect.utilities.annotations import quote

from engine.config import TrellisConfig
from engine.run.metrics import RunCounters, RunDevices, StepRecord
from engine.run.step import Batch, Evaluation, Logged, Pending, Prepared
from tasks import log_step as log_tasks
from tasks import step_tasks as tasks


class TaskPhases:
    def __init__(self, config: TrellisConfig, devices: RunDevices) -> None:
        # Quoted: Prefect would otherwise walk the whole config looking for futures on every task call.
        self._config = quote(config)
        self._devices = devices  # the run plan's, for the per-device throughput/* of log_step

    def produce_batch(self, step: int) -> Batch:
        return tasks.produce_batch(self._config, step)

    def load_batch(self, step: int) -> Batch:
        return tasks.load_batch(self._config, step)

    def write_trajectories(self, step: int, batch: Batch) -> Pending[str]:
        return tasks.write_trajectories.submit(self._config, step, batch)

    def prepare_data(self, step: int, batch: Batch) -> Prepared:
        return tasks.prepare_data(self._config, step, batch)

    def fit(self, step: int, prepared: Prepared) -> dict[str, float]:
        return tasks.fit(self._config, step, prepared)

    def save_checkpoint(self, step: int) -> str:
        return tasks.save_checkpoint(self._config, step)

    def export_hf(self, step: int) -> str:
        return tasks.export_hf(self._config, step)

    def sync_weights(self, step: int) -> None:
        tasks.sync_weights(self._config, step)

    def evaluate(self, step: int) -> Evaluation:
        return tasks.evaluate(self._config, step)

    def start_rollout(self, step: int) -> None:
        tasks.start_rollout(self._config, step)

    def log_step(self, step: int, record: StepRecord) -> Logged:
        return log_tasks.log_step(self._config, step, record, self._devices)

    def commit_checkpoint(self, step: int, counters: RunCounters) -> str:
        return tasks.commit_checkpoint(self._config, step, counters)

    def log_evaluation(self, step: int, evaluation: Evaluation) -> dict[str, float]:
        return log_tasks.log_evaluation(self._config, step, evaluation)

    def get_batch(self, step: int) -> Batch:
        return tasks.get_batch(self._config, step)

    def pause_produce(self, step: int) -> float:
        return tasks.pause_produce(self._config, step)

    def continue_produce(self, step: int) -> None:
        tasks.continue_produce(self._config, step)
