"""The tasks around a run's steps: attach to its workers, decide where it starts (the run plan), and
release the workers at the end."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from prefect import get_client, get_run_logger, task
from prefect.exceptions import MissingContextError
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run

from trellis.engine.cluster.head import connect
from trellis.engine.cluster.ray_workers import RayWorkers
from trellis.engine.cluster.workers import RunWorkers
from trellis.engine.config import TrellisConfig
from trellis.engine.errors import SettingError
from trellis.engine.run.metrics import RunCounters
from trellis.engine.run.loop import write_run_report
from trellis.engine.run.plan import RunPlan, WorkerFacts, record_run_config, record_run_plan, resolve_run_plan
from trellis.engine.run.resume import plan_start, record_owner, started_by
from trellis.engine.run.run_log import (
    RunLog,
    RunLogHandler,
    after_failure,
    record_failure,
    record_start,
    run_log_for,
)
from trellis.engine.secrets import install_log_redaction, write_runtime_environment
from trellis.engine.storage.checkpoints import require_complete
from trellis.engine.storage.store import Store
from trellis.engine.storage.ledger import forget_after
from trellis.engine.storage.lineage import record_run_origin
from trellis.tasks.artifacts import artifact_key, storage_link
from trellis.tasks.step_tasks import NOT_STORED, unless_a_setting_error


@task(name="attach_workers", retries=2, retry_delay_seconds=2, retry_condition_fn=unless_a_setting_error, **NOT_STORED)
def attach_workers(config: TrellisConfig) -> WorkerFacts:
    """Connect to the cluster and get (or create) the run's named actors; report where they stand."""
    install_log_redaction(config.storage_options)
    address = connect(config.cluster)
    write_runtime_environment(config.run_uri, config.storage_options)
    facts = RunWorkers(config).attach()
    get_run_logger().info("Workers on %s; train prompts: %s", address, facts.train_report)
    return facts


@task(name="restore_checkpoint", retries=1, retry_delay_seconds=2, **NOT_STORED)
def restore_checkpoint(config: TrellisConfig, resume: bool, facts: WorkerFacts) -> RunPlan:
    """Decide where the run starts (``engine.run.resume.plan_start``), bring the workers there, and
    resolve the run plan every step follows. The flow run's retry resumes from the latest complete
    checkpoint, but only if the failed attempt got past this decision (a refused fresh start stays
    refused)."""
    attempt = str(flow_run.get_id())
    resume = resume or (flow_run.get_run_count() > 1 and started_by(config, attempt))
    start = plan_start(config, resume=resume, applied_step=facts.applied_step, workers_used=facts.holds_state)
    RunWorkers(config).restore(start)
    state = require_complete(Store(start.checkpoint, config.storage_options)) if start.checkpoint is not None else None
    plan = resolve_run_plan(config, facts, start, RunCounters.resumed(state))
    RayWorkers(config).open_trackers(plan.first_step)
    record_run_config(config)
    record_run_plan(config, plan)
    record_start(config, plan, attempt=flow_run.get_run_count())
    record_run_origin(config, start)
    forget_after(Store(config.run_uri, config.storage_options), start.step)  # the ledger of the steps to be run again
    record_owner(config, attempt)
    logger = get_run_logger()
    if start.action != "fresh":
        logger.info("Start: %s at step %d %s", start.action, start.step, start.checkpoint or "")
    if plan.first_step > plan.total_steps:
        logger.info("The run is already at step %d of %d: nothing to train.", start.step, plan.total_steps)
    create_table_artifact(
        key=artifact_key(config, "run-plan"),
        table=[{"field": k, "value": str(v)} for k, v in plan.model_dump().items()],
        description=f"{config.experiment_name}: the run plan",
    )
    return plan


@task(name="release_workers", **NOT_STORED)
def release_workers(config: TrellisConfig) -> None:
    RunWorkers(config).release()


@task(name="publish_report", **NOT_STORED)
def publish_report(config: TrellisConfig) -> str | None:
    """The run's report (``engine.storage.report``) beside it, and its headline as an artifact. A report
    that cannot be drawn is a warning, never a failed run."""
    report = write_run_report(config)
    if report is None:
        return None
    create_markdown_artifact(
        key=artifact_key(config, "report"),
        markdown=report.markdown(storage_link(config, report.html_uri)),
        description=f"{config.experiment_name}: the run's report",
    )
    return report.html_uri


@task(name="close_trackers", **NOT_STORED)
def close_trackers(config: TrellisConfig) -> None:
    RayWorkers(config).close_trackers()


@contextmanager
def engine_warnings_in_run_log(config: TrellisConfig) -> Iterator[RunLog]:
    """The engine's warnings (a worker replaced, a group skipped) go to the run's text log too, and the run
    log's lines (each step's summary, the warnings, a failure's cause) to the Prefect logger of the flow or
    task run writing them, so that the UI shows what the console shows."""
    run_log = run_log_for(config)
    handler = RunLogHandler(run_log)
    logging.getLogger("trellis.engine").addHandler(handler)
    run_log.listeners.append(_to_prefect_logger)
    try:
        yield run_log
    finally:
        logging.getLogger("trellis.engine").removeHandler(handler)
        run_log.listeners.remove(_to_prefect_logger)


_PREFECT_LEVELS = {"STEP": logging.INFO, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}


def _to_prefect_logger(level: str, text: str) -> None:
    """A run log line to the flow or task run writing it. Prefect's run loggers follow
    ``PREFECT_LOGGING_LEVEL``, which ``trellis train`` raises to WARNING to keep the engine's own lines
    ("Finished in state Completed()") off its console; below that level a run log line still goes to the
    run logger's own handlers (by default the API's, so the UI shows it), not to the console."""
    try:
        logger = get_run_logger()
    except MissingContextError:  # written outside any flow or task run
        return
    number = _PREFECT_LEVELS.get(level, logging.INFO)
    if logger.isEnabledFor(number):
        logger.log(number, text)
        return
    message, kwargs = logger.process(text, {})
    record = logger.logger.makeRecord(logger.logger.name, number, __name__, 0, message, None, None, extra=kwargs["extra"])
    for handler in logger.logger.handlers:
        if number >= handler.level:
            handler.handle(record)


@dataclass
class AttemptProgress:
    """How far an attempt of the run got: past its start decision (a retry then resumes), at which step."""

    started: bool = False
    step: int | None = None

    @property
    def during(self) -> str:
        return f"step {self.step}" if self.step is not None else "the run's start"


@contextmanager
def failures_in_run_log(config: TrellisConfig) -> Iterator[AttemptProgress]:
    """A failed attempt writes to the run log what failed, why and what happens next (a retry, from
    which checkpoint, or the end of the run), with the traceback. A setting error is not retried."""
    progress = AttemptProgress()
    try:
        yield progress
    except Exception as error:
        attempt, retries, setting = flow_run.get_run_count(), config.cluster.flow_retries, isinstance(error, SettingError)
        if setting and attempt <= retries:
            _end_retries()
        next_move = after_failure(config, started=progress.started, attempt=attempt, retries=retries, setting=setting)
        record_failure(config, error, during=progress.during, next_move=next_move)
        raise


def _end_retries() -> None:
    """Prefect's flows take no retry condition (its tasks do): the server retries a failed flow run
    while its run count is within its policy's retries, so the policy is lowered to the count reached."""
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run.get_id())
        client.update_flow_run(run.id, empirical_policy=run.empirical_policy.model_copy(update={"retries": run.run_count - 1}))
