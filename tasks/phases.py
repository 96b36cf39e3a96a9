"""The flow's runner of the phases (``engine.run.step.PhaseRunner``): inside a step's flow run, every
phase is its Prefect task (``tasks.step_tasks``), a named task run (``fit[step=12]``);
``write_trajectories`` is submitted, so it runs beside ``prepare_data`` and ``fit``."""

from __future__ import annotations

from typing import Any

from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from trellis.engine.config import TrellisConfig
from trellis.engine.run.phases import Phase
from trellis.engine.run.plan import RunPlan
from trellis.engine.run.tracing import close_tracer, mark_task_run
from trellis.tasks import run_tasks
from trellis.tasks.step_tasks import PHASE_TASKS


class TaskPhases:
    def __init__(self, config: TrellisConfig, plan: RunPlan) -> None:
        # Quoted: Prefect would otherwise walk the whole config and plan looking for futures on every task call.
        self._config, self._plan = config, plan
        self.config = config
        self._quoted = (quote(config), quote(plan))

    def run(self, phase: Phase, step: int, *inputs: Any) -> Any:
        state = PHASE_TASKS[phase.name](*self._quoted, step, inputs, return_state=True)
        mark_task_run(str(state.state_details.task_run_id), f"{phase.name}[step={step}]")  # on its span, when traced
        return state.result()

    def submit(self, phase: Phase, step: int, *inputs: Any) -> PrefectFuture[Any]:
        future = PHASE_TASKS[phase.name].submit(*self._quoted, step, inputs)
        mark_task_run(str(future.task_run_id), f"{phase.name}[step={step}]")
        return future

    def close_trackers(self) -> None:
        run_tasks.close_trackers(self._config)
        close_tracer(self._config)

    def publish_report(self) -> None:
        run_tasks.publish_report(self._config)

    def trace_attributes(self) -> dict[str, str]:
        return {"prefect.flow_run_id": str(flow_run.get_id())} if flow_run.get_id() else {}

    def announce_trace(self, trace_id: str, step: int) -> None:
        """The step's flow run logs its trace's id: from the Prefect UI to the trace."""
        if flow_run.get_id():
            get_run_logger().info(f"OpenTelemetry trace {trace_id} (step {step})")
