"""Evaluate a stored policy (a run's checkpoint or HF export) on the run's eval set, outside training:
the eval rows go into the lake (``split=checkpoint_eval``), and the evaluation into the lineage."""

from __future__ import annotations

from dataclasses import dataclass

from trellis.engine.config import TrellisConfig
from trellis.engine.devices import set_up_process
from trellis.engine.rollout.backends.registry import build_rollout_backend
from trellis.engine.rollout.production.controller import Controller
from trellis.engine.run.checkpoint_source import PolicySource, policy_weights, resolve_source
from trellis.engine.storage.lineage import record_evaluation
from trellis.engine.storage.store import Store

SPLIT = "checkpoint_eval"


class EvaluationError(ValueError):
    """The run cannot be evaluated as asked (no eval set, say)."""


@dataclass(frozen=True)
class CheckpointEvaluation:
    source: PolicySource
    metrics: dict[str, float]
    partition: str  # the eval rows in the lake
    by_data_source: dict[str, dict[str, float]]


def evaluate_checkpoint(
    config: TrellisConfig,
    checkpoint: str | None = None,
    flow_run_id: str | None = None,
    *,
    samples_per_prompt: int | None = None,
    temperature: float | None = None,
) -> CheckpointEvaluation:
    """``samples_per_prompt`` and ``temperature`` replace the config's eval settings (pass@k needs
    k > 1 samples, and sampling rather than greedy decoding, to say more than accuracy)."""
    if not config.eval_datasets:
        raise EvaluationError(f"{config.experiment_name}: the config has no eval_dataset to evaluate on.")
    changes = {"eval_samples_per_prompt": samples_per_prompt, "eval_temperature": temperature}
    changes = {k: v for k, v in changes.items() if v is not None}
    if changes:
        config = config.model_copy(update={"rollout": config.rollout.model_validate({**config.rollout.model_dump(), **changes})})
    source = resolve_source(config, checkpoint)
    set_up_process(config)
    controller = Controller(config)
    try:
        backend = build_rollout_backend(config, controller.tokenizer)
        backend.load_weights(policy_weights(config, source), policy_version=source.step)
        groups, metrics = controller.evaluate(source.step, backend)
        partition, _ = controller.write_trajectories(groups, source.step, SPLIT, flow_run_id)
    finally:
        controller.close()
    record_evaluation(
        Store(config.run_uri, config.storage_options), step=source.step, checkpoint=source.uri, flow_run_id=flow_run_id,
        partition=partition, metrics=metrics,
    )
    return CheckpointEvaluation(source, metrics, partition, _by_data_source(metrics, groups))


def _by_data_source(metrics: dict[str, float], groups) -> dict[str, dict[str, float]]:
    """``{source: {accuracy, pass@k, ...}}``; one source's figures are the overall ones."""
    sources = sorted({group[0].data_source for group in groups})
    if len(sources) == 1:
        return {sources[0]: {k: v for k, v in metrics.items() if "/" not in k}}
    table: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        source, slash, name = key.rpartition("/")
        if slash and source in sources:
            table.setdefault(source, {})[name] = value
    return table
