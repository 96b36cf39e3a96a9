"""One Prefect task per phase of ``engine.run.phases``, made from its row: the task's name and run name
(``fit[step=12]``), its retries, what a retry does first, and the artifacts it publishes. Each task runs
the phase over the run's Ray actors (``engine.cluster.ray_workers``).

Task options follow side effects, as each row says: reads and idempotent writes retry (produce_batch
collects or redraws the same prompts on a retry; a trajectory part is replaced, not appended), while
``fit`` never retries and refuses a step its worker has already applied. Batches stay with the
controller, named by step: a task hands Prefect a few numbers and, for the trainer, an ``ObjectRef``.
"""

from __future__ import annotations

from typing import Any, Callable

from prefect import Task, task
from prefect.artifacts import LinkArtifact, TableArtifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from trellis.engine.cluster.ray_workers import RayWorkers
from trellis.engine.config import TrellisConfig
from trellis.engine.errors import SettingError
from trellis.engine.run.phases import PHASES, Phase, PhaseContext, Retries, run_phase
from trellis.engine.run.plan import RunPlan
from trellis.engine.run.rollback import StabilityGuardTripped, rolled_back_page
from trellis.engine.run.run_log import run_log_for
from trellis.engine.weights.attestation import WeightAttestationError
from trellis.tasks.artifact_posts import post
from trellis.tasks.artifacts import artifact_key, storage_link

NOT_STORED = dict(cache_policy=NO_CACHE, persist_result=False)


def unless_a_setting_error(task, task_run, state) -> bool:
    """Retry a failed task unless a setting the user must change failed it (the retry would meet it
    again), or a weight sync failed its attestation after syncing again already."""
    return not isinstance(state.result(raise_on_failure=False), (SettingError, WeightAttestationError))


def task_options(retries: Retries) -> dict[str, Any]:
    options: dict[str, Any] = dict(retries=retries.count, **NOT_STORED)
    if retries.count:
        options["retry_delay_seconds"] = retries.delay_s
        if retries.unless_setting_error:
            options["retry_condition_fn"] = unless_a_setting_error
    return options


def _metrics_table(config: TrellisConfig, step: int, inputs: tuple, logged: Any) -> None:
    post(TableArtifact(
        key=artifact_key(config, "step-metrics"),
        table=[{"metric": k, "value": round(v, 6)} for k, v in sorted(logged.metrics.items())],
        description=f"{config.experiment_name}: metrics of step {step}",
    ))


def _step_links(config: TrellisConfig, step: int, inputs: tuple, result: Any) -> None:
    (record,) = inputs
    for name, uri in record.links.items():
        post(LinkArtifact(key=artifact_key(config, name), link=storage_link(config, uri), link_text=f"{name} of step {step}: {uri}"))


def _checkpoint_link(config: TrellisConfig, step: int, inputs: tuple, uri: Any) -> None:
    post(LinkArtifact(key=artifact_key(config, "checkpoint"), link=storage_link(config, uri), link_text=f"checkpoint of step {step}: {uri}"))


def _eval_link(config: TrellisConfig, step: int, inputs: tuple, result: Any) -> None:
    (evaluation,) = inputs
    post(LinkArtifact(key=artifact_key(config, "eval-trajectories"), link=storage_link(config, evaluation.uri),
                      link_text=f"eval trajectories of step {step}: {evaluation.uri}"))


def _guard_page(config: TrellisConfig, step: int, inputs: tuple, rolled: Any) -> None:
    create_markdown_artifact(key=artifact_key(config, "stability-guard"), markdown=rolled_back_page(rolled, config.guard),
                             description=f"{config.experiment_name}: the stability guard tripped at step {step} and rolled back")


def _nothing(config: TrellisConfig, step: int, inputs: tuple, result: Any) -> None:
    """Metrics join the step's record, which log_step publishes."""


PUBLISHERS: dict[str, Callable[[TrellisConfig, int, tuple, Any], None]] = {
    "metrics": _nothing, "metrics_table": _metrics_table, "step_links": _step_links, "checkpoint_link": _checkpoint_link,
    "eval_link": _eval_link, "guard_page": _guard_page,
}


def phase_task(phase: Phase) -> Task:
    def run(config: TrellisConfig, plan: RunPlan, step: int, inputs: tuple = ()) -> Any:
        ctx = PhaseContext(config, plan, RayWorkers(config), origin=str(flow_run.get_id()))
        if task_run.run_count > 1 and phase.on_retry:
            doing = ", then ".join(hook.doing for hook in phase.on_retry)
            run_log_for(config).warning(f"{task_run.name}: retry {task_run.run_count - 1} after a failure; {doing}")
            for hook in phase.on_retry:
                hook.fn(ctx)
        try:
            result = run_phase(phase, ctx, step, *inputs)
        except WeightAttestationError as error:
            create_markdown_artifact(key=artifact_key(config, "weight-attestation"), markdown=error.page,
                                     description=f"{config.experiment_name}: the failed weight attestation of step {step}")
            raise
        except StabilityGuardTripped as error:
            create_markdown_artifact(key=artifact_key(config, "stability-guard"), markdown=error.page,
                                     description=f"{config.experiment_name}: the stability guard stopped the run at step {step}")
            raise
        for kind in phase.publishes:
            PUBLISHERS[kind](config, step, inputs, result)
        return result

    run.__name__ = run.__qualname__ = phase.name  # what Prefect keys the task by
    run.__doc__ = phase.body.__doc__
    return task(name=phase.name, task_run_name=f"{phase.name}[step={{step}}]", **task_options(phase.retries))(run)


PHASE_TASKS: dict[str, Task] = {name: phase_task(phase) for name, phase in PHASES.items()}
