"""Score a run's stored trajectories again with another reward function, into a new lake split, with a
comparison of old and new rewards as an artifact."""

from __future__ import annotations

from prefect import flow

from trellis.engine.config import TrellisConfig
from trellis.tasks.offline_tasks import rescore_task


@flow(name="rescore", flow_run_name="rescore[{config.experiment_name}]", persist_result=False)
def rescore(
    config: TrellisConfig, reward_function: str, split: str = "train", steps: list[int] | None = None, into: str | None = None
) -> str:
    """``reward_function``: ``module:function``; ``steps``: all stored ones when empty; ``into``: the new
    split's name (default ``rescore-<function>``). Returns the split written."""
    return rescore_task(config, reward_function, split, steps, into)
