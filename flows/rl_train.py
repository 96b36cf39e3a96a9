"""The RL loop as Prefect flows.

    rl_train[experiment]              the run; launch it from the CLI, a deployment or a schedule
      └─ rl_run[experiment]           one attempt, retried ``cluster.flow_retries`` times by Prefect;
           │                          a retry resumes from the last complete checkpoint
           ├─ attach_workers, restore_checkpoint (-> the run plan)
           └─ rl_step[step=N] ...     one flow run per step: the phases of ``engine.run.step`` as tasks

The run around the steps, the order of a step's phases and which are due are the engine's
(``engine.run.loop``, ``engine.run.step``, ``engine.run.plan``), shared with the in-process runner;
these flows add Prefect around them: a flow run per attempt and per step, tasks for the phases.
"""

from __future__ import annotations

from prefect import flow
from prefect.settings import temporary_settings

from trellis.engine.config import TrellisConfig
from trellis.engine.run.metrics import RunCounters
from trellis.engine.run.plan import RunPlan, plan_step
from trellis.engine.run.loop import run_steps
from trellis.engine.run.step import StepOutcome, run_step
from trellis.flows.prefect_settings import on_trellis_temporary_server, step_loop_settings
from trellis.tasks.artifact_posts import posting_in_background
from trellis.tasks.phases import TaskPhases
from trellis.tasks.run_tasks import (
    attach_workers,
    engine_warnings_in_run_log,
    failures_in_run_log,
    release_workers,
    restore_checkpoint,
)


# validate_parameters=False: the run's config was validated when it was loaded, and validating it again
# (every cross-field rule) on each step's flow run is CPU the workers' cores pay for.
@flow(name="rl_step", flow_run_name="rl_step[step={step}]", persist_result=False, validate_parameters=False)
def rl_step(config: TrellisConfig, plan: RunPlan, step: int, counters: RunCounters) -> StepOutcome:
    return run_step(TaskPhases(config, plan), plan_step(config, plan, step), counters)


@flow(name="rl_run", flow_run_name="rl_run[{config.experiment_name}]", persist_result=False)
def rl_run(config: TrellisConfig, resume: bool = False) -> dict[str, float]:
    """One attempt at the run: attach to the workers, restore where it starts, then ``run_steps`` with one
    ``rl_step`` flow run per step. A Prefect retry of a failed attempt resumes from the latest complete
    checkpoint, if the failed attempt got past its start decision; a failure is written to the run log
    with what happens next."""
    with engine_warnings_in_run_log(config) as run_log, failures_in_run_log(config) as attempt:
        plan = restore_checkpoint(config, resume, attach_workers(config))
        attempt.started = True
        # No heartbeats a step, no TLS roots for plain HTTP, and the steps' artifacts posted without waiting
        # where the server lets them (tasks.artifact_posts).
        with temporary_settings(step_loop_settings()), posting_in_background(on_trellis_temporary_server(), run_log.warning):
            outcomes = run_steps(
                TaskPhases(config, plan), config, plan, lambda step, counters: rl_step(config, plan, step, counters),
                progress=attempt,
            )
    if config.cluster.release_workers_at_end:
        release_workers(config)
    return outcomes[-1].metrics if outcomes else {}


@flow(name="rl_train", flow_run_name="rl_train[{config.experiment_name}]", persist_result=False)
def rl_train(config: TrellisConfig, resume: bool = False) -> dict[str, float]:
    """Train to the run's total steps. With ``resume`` (or ``auto_resume``) the run continues from its
    latest complete checkpoint; otherwise a re-run continues live workers."""
    attempt = rl_run.with_options(retries=config.cluster.flow_retries, retry_delay_seconds=2)
    return attempt(config, resume)
