"""The flow's runner of the phases (``engine.run.step.PhaseRunner``): inside a step's flow run, every
phase is its Prefect task (``tasks.step_tasks``), a named task run (``fit[step=12]``);
``write_trajectories`` is submitted, so it runs beside ``prepare_data`` and ``fit``."""

from __future__ import annotations

from typing import Any

from prefect.futures import PrefectFuture
from prefect.utilities.annotations import quote

from trellis.engine.config import TrellisConfig
from trellis.engine.run.phases import Phase
from trellis.engine.run.plan import RunPlan
from trellis.tasks import run_tasks
from trellis.tasks.step_tasks import PHASE_TASKS


class TaskPhases:
    def __init__(self, config: TrellisConfig, plan: RunPlan) -> None:
        # Quoted: Prefect would otherwise walk the whole config and plan looking for futures on every task call.
        self._config, self._plan = config, plan
        self._quoted = (quote(config), quote(plan))

    def run(self, phase: Phase, step: int, *inputs: Any) -> Any:
        return PHASE_TASKS[phase.name](*self._quoted, step, inputs)

    def submit(self, phase: Phase, step: int, *inputs: Any) -> PrefectFuture[Any]:
        return PHASE_TASKS[phase.name].submit(*self._quoted, step, inputs)

    def close_trackers(self) -> None:
        run_tasks.close_trackers(self._config)

    def publish_report(self) -> None:
        run_tasks.publish_report(self._config)
