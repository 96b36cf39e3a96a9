"""Tasks of the flows that work on a run's stored results (evaluate a checkpoint, rescore stored
trajectories, replay a step, export a checkpoint): each does its work in the flow's own process and leaves Prefect
artifacts that say what it found and where it wrote."""

from __future__ import annotations

from dataclasses import asdict

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run

from trellis.engine.config import RewardConfig, TrellisConfig
from trellis.engine.run.evaluate_checkpoint import evaluate_checkpoint
from trellis.engine.run.export import export_checkpoint
from trellis.engine.run.replay import comparison_markdown, replay_step
from trellis.engine.run.rescore import rescore_run
from trellis.engine.secrets import install_log_redaction
from trellis.engine.storage.store import Store
from trellis.tasks.artifacts import artifact_key, storage_link
from trellis.tasks.run_tasks import publish_report
from trellis.tasks.step_tasks import NOT_STORED


def _flow_run_id() -> str | None:
    run_id = flow_run.get_id()
    return str(run_id) if run_id else None


@task(name="evaluate_checkpoint", **NOT_STORED)
def evaluate_checkpoint_task(
    config: TrellisConfig, checkpoint: str | None, samples_per_prompt: int | None, temperature: float | None
) -> dict[str, float]:
    install_log_redaction(config.storage_options)
    evaluation = evaluate_checkpoint(config, checkpoint, _flow_run_id(), samples_per_prompt=samples_per_prompt, temperature=temperature)
    step = evaluation.source.step
    create_table_artifact(
        key=artifact_key(config, "checkpoint-eval"),
        table=[{"data_source": source, **{k: round(v, 4) for k, v in figures.items()}} for source, figures in evaluation.by_data_source.items()],
        description=f"{config.experiment_name}: evaluation of {evaluation.source.uri} (step {step}), by data source",
    )
    create_link_artifact(
        key=artifact_key(config, "checkpoint-eval-rows"),
        link=storage_link(config, evaluation.partition),
        link_text=f"eval rows of step {step}: {evaluation.partition}",
    )
    publish_report(config)
    return {"step": float(step), **evaluation.metrics}


@task(name="export", **NOT_STORED)
def export_task(config: TrellisConfig, checkpoint: str | None, out: str | None) -> str:
    install_log_redaction(config.storage_options)
    source, uri = export_checkpoint(config, checkpoint, out, _flow_run_id())
    create_link_artifact(key=artifact_key(config, "export"), link=storage_link(config, uri), link_text=f"HF export of step {source.step}: {uri}")
    return uri


@task(name="rescore", **NOT_STORED)
def rescore_task(config: TrellisConfig, reward_function: str, split: str, steps: list[int] | None, into: str | None) -> str:
    install_log_redaction(config.storage_options)
    reward = RewardConfig(function=reward_function, timeout_s=config.reward.timeout_s, num_workers=config.reward.num_workers)
    result = rescore_run(
        Store(config.run_uri, config.storage_options), reward, split=split, steps=steps, into=into, flow_run_id=_flow_run_id()
    )
    create_table_artifact(
        key=artifact_key(config, "rescore"),
        table=result.table(),
        description=f"{config.experiment_name}: split={split} rescored by {reward_function} into split={result.split} "
        f"(old and new mean reward per step; agreement = both call a sample correct, or both wrong)",
    )
    return result.split


@task(name="replay", **NOT_STORED)
def replay_task(config: TrellisConfig, step: int, changes: list[str], name: str | None) -> dict:
    install_log_redaction(config.storage_options)
    comparison = replay_step(Store(config.run_uri, config.storage_options), step, changes, name=name)
    create_markdown_artifact(
        key=artifact_key(config, f"replay-{step}"),
        markdown=comparison_markdown(comparison),
        description=f"{config.experiment_name}: step {step} applied again with {', '.join(changes) or 'no change'}",
    )
    return asdict(comparison)
