"""Export a run's checkpoint (its latest complete one, or the one given) as an HF folder at any fsspec
URI (default ``{run}/exports/step-N``)."""

from __future__ import annotations

from prefect import flow

from trellis.engine.config import TrellisConfig
from trellis.tasks.offline_tasks import export_task


@flow(name="export", flow_run_name="export[{config.experiment_name}]", persist_result=False)
def export(config: TrellisConfig, checkpoint: str | None = None, out: str | None = None) -> str:
    return export_task(config, checkpoint, out)
