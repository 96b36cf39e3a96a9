"""What every phase body of a step gets (``engine.run.phases``)."""

from __future__ import annotations

from dataclasses import dataclass

from trellis.engine.config import TrellisConfig
from trellis.engine.run.plan import RunPlan
from trellis.engine.run.workers import Workers


@dataclass(frozen=True)
class PhaseContext:
    config: TrellisConfig
    plan: RunPlan
    workers: Workers
    origin: str | None = None  # the orchestrator run writing (a Prefect flow run id), for the lake's lineage
