"""Apply one stored step of a run again, with the run's settings and with changed ones, from the policy
before it; the comparison of the two updates as an artifact (``engine.run.replay``)."""

from __future__ import annotations

from prefect import flow

from trellis.engine.config import TrellisConfig
from trellis.tasks.offline_tasks import replay_task


@flow(name="replay", flow_run_name="replay[{config.experiment_name}@{step}]", persist_result=False)
def replay(config: TrellisConfig, step: int, changes: list[str] | None = None, name: str | None = None) -> dict:
    """``changes``: ``key=value`` settings for the second update (``loss.clip_eps_high=0.28``); none
    replays the step as the run applied it. ``name``: the replay's folder under ``{run}/replays/``.
    Returns the comparison."""
    return replay_task(config, step, changes or [], name)
