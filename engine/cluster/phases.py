"""The phases of a step (``engine.run.step``) as calls to a run's Ray actors.

Batches stay in Ray's object store: a phase returns an ``ObjectRef`` and a few numbers, never
tensors, to the orchestrator. The Prefect tasks of ``tasks/`` are thin wrappers over these methods.
"""

from __future__ import annotations

import time

from engine.cluster.workers import RunWorkers
from engine.config import TrellisConfig
from engine.run.metrics import RunCounters, RunDevices, StepRecord, assemble_step_metrics
from engine.run.resume import (
    begin_checkpoint,
    begin_hf_export,
    seal_checkpoint,
    seal_hf_export,
    train_state,
)
from engine.run.run_log import record_step
from engine.run.step import Batch, Done, Evaluation, Logged, Prepared
from engine.storage.checkpoints import step_name


_POLL_S = 2.0


class ClusterPhases:
    def __init__(self, config: TrellisConfig) -> None:
        self.config = config
        self.workers = RunWorkers(config)

    def produce_batch(self, step: int) -> Batch:
        """Collects the batch ``start_rollout`` launched ahead, or launches it now."""
        workers = self.workers
        workers.hand_accelerator_to("rollout")
        summary_ref, samples_ref = workers.actor("controller").produce_batch.remote(step, workers.actors("rollout"))
        summary = workers.wait(summary_ref)
        return Batch(summary, samples_ref, summary["launched_s"])

    def start_rollout(self, step: int) -> None:
        """Launch ``step``'s rollout and return without waiting; the controller keeps the batch for
        ``produce_batch[step]``."""
        workers = self.workers
        workers.hand_accelerator_to("rollout")
        workers.actor("controller").produce_batch.remote(step, workers.actors("rollout"))

    def get_batch(self, step: int) -> Batch:
        """disaggregated: the next batch from the producer's replay buffer, asked for every few
        seconds (each ask holds the controller that long) until ``cluster.ray_get_timeout_s``."""
        deadline = time.monotonic() + self.config.cluster.ray_get_timeout_s
        while True:
            summary_ref, samples_ref = self.workers.actor("controller").get_batch.remote(step, _POLL_S)
            summary = self.workers.wait(summary_ref)
            if summary["ready"]:
                return Batch(summary, samples_ref)
            if time.monotonic() > deadline:
                raise TimeoutError(f"No batch for step {step} within {self.config.cluster.ray_get_timeout_s:g}s.")

    def restart_producer(self) -> None:
        """A retried get_batch: the producer starts again on the (perhaps replaced) rollout worker."""
        workers = self.workers
        workers.wait(workers.actor("controller").restart_produce.remote(workers.actors("rollout")))

    def pause_produce(self, step: int) -> float:
        return self.workers.wait(self.workers.actor("controller").pause_produce.remote())

    def continue_produce(self, step: int) -> None:
        """The producer goes on with the weights of ``step``, which the rollout now serves."""
        workers = self.workers
        workers.wait(workers.actor("controller").continue_produce.remote(step, workers.actors("rollout")))

    def load_batch(self, step: int) -> Batch:
        """debug_train: a stored batch from the Parquet lake instead of a rollout."""
        summary_ref, samples_ref = self.workers.actor("controller").load_batch.remote(step)
        return Batch(self.workers.wait(summary_ref), samples_ref, time.time())

    def write_trajectories(self, step: int, batch: Batch, split: str = "train", flow_run_id: str | None = None) -> Done[str]:
        controller = self.workers.actor("controller")
        return Done(self.workers.wait(controller.write_trajectories.remote(batch.samples, step, split, flow_run_id)))

    def prepare_data(self, step: int, batch: Batch) -> Prepared:
        info_ref, prepared_ref = self.workers.actor("controller").prepare_data.remote(batch.samples, step)
        return Prepared(self.workers.wait(info_ref), prepared_ref)

    def fit(self, step: int, prepared: Prepared) -> dict[str, float]:
        self.workers.hand_accelerator_to("trainer")
        ranks = self.workers.actors("trainer")
        return self.workers.wait([rank.fit.remote(prepared.sequences, step) for rank in ranks])[0].metrics

    def save_checkpoint(self, step: int) -> str:
        """Every worker writes its part of the checkpoint in parallel; ``commit_checkpoint`` seals it."""
        uri, config = begin_checkpoint(self.config, step), self.config
        waits = [self.workers.actor("controller").save_checkpoint.remote(uri)]
        if "trainer" in self.workers.roles:
            save_optimizer = not config.checkpoint_no_save_optimizer
            waits += [t.save_checkpoint.remote(uri, config.storage_options, save_optimizer) for t in self.workers.actors("trainer")]
        self.workers.wait(waits)
        return uri

    def export_hf(self, step: int) -> str:
        """``save_pretrained`` model + tokenizer under ``{run}/hf/step-NNNNNN``, pruned to ``hf_max_keep``."""
        uri, config = begin_hf_export(self.config, step), self.config
        ranks = self.workers.actors("trainer")  # all gather the full weights; rank 0 writes them
        self.workers.wait([rank.export_hf.remote(uri, config.storage_options, config.tokenizer_source) for rank in ranks])
        seal_hf_export(config, step)
        return uri

    def sync_weights(self, step: int) -> None:
        self.workers.sync_weights(step)

    def evaluate(self, step: int, flow_run_id: str | None = None) -> Evaluation:
        workers = self.workers
        workers.hand_accelerator_to("rollout")
        uri, metrics = workers.wait(workers.actor("controller").evaluate.remote(step, workers.actors("rollout"), flow_run_id))
        return Evaluation(uri, metrics)

    def log_step(self, step: int, record: StepRecord, devices: RunDevices) -> Logged:
        """``devices``: the run plan's, which the per-device ``throughput/*`` divide by."""
        metrics, counters = assemble_step_metrics(record, devices)
        self.workers.wait(self.workers.actor("controller").log_metrics.remote(metrics, step))
        record_step(self.config, step, metrics)
        return Logged(metrics, counters)

    def commit_checkpoint(self, step: int, counters: RunCounters) -> str:
        seal_checkpoint(self.config, step, train_state(step, counters))
        return f"{self.config.checkpoint_uri}/{step_name(step)}"

    def log_evaluation(self, step: int, evaluation: Evaluation) -> dict[str, float]:
        metrics = {f"eval/{k}": v for k, v in evaluation.metrics.items()}
        self.workers.wait(self.workers.actor("controller").log_metrics.remote(metrics, step))
        return metrics

    def open_trackers(self, first_step: int) -> None:
        self.workers.wait(self.workers.actor("controller").open_trackers.remote(first_step))

    def close_trackers(self) -> None:
        self.workers.wait(self.workers.actor("controller").close_trackers.remote())
