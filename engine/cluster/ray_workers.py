"""The ``Workers`` interface (``engine.run.workers``) over a run's Ray actors: the phases of
``engine.run.phases`` call these, and every actor shell answers them with one generic method
(``call``: ``fn(worker, *args)`` on its plain object; the controller's ``drive`` adds the rollout
engines). Each call is named after its phase (``controller.write_trajectories``), so that a failed
worker is reported in the phase it failed in, and Ray's dashboard shows the phases. Results come back
through ``RunWorkers.wait`` (bounded, and naming a failed worker); a kept result stays in the object
store, its reference handed to the next phase."""

from __future__ import annotations

from typing import Any, Callable

from trellis.engine.cluster.health import check_and_replace
from trellis.engine.cluster.workers import RunWorkers
from trellis.engine.config import TrellisConfig
from trellis.engine.run.plan import Role
from trellis.engine.run.workers import Call


class RayWorkers:
    def __init__(self, config: TrellisConfig, *, cluster: RunWorkers | None = None, phase: str | None = None) -> None:
        self.cluster = RunWorkers(config) if cluster is None else cluster
        self.roles: tuple[Role, ...] = self.cluster.roles
        self._phase = phase

    def named(self, phase: str) -> RayWorkers:
        return RayWorkers(self.cluster.config, cluster=self.cluster, phase=phase)

    def _options(self, role: Role, **options: Any) -> dict[str, Any]:
        return {**options, "name": f"{role}.{self._phase}"} if self._phase else options

    def run(self, *calls: Call) -> list[list[Any]]:
        return self.cluster.run_calls(*[(call.role, call.fn, call.args) for call in calls], phase=self._phase)

    def keep(self, role: Role, fn: Callable[..., tuple[Any, Any]], *args: Any) -> tuple[Any, Any]:
        small, large = self.cluster.actor(role).call.options(**self._options(role, num_returns=2)).remote(fn, *args)
        return self.cluster.wait(small), large

    def drive(self, fn: Callable[..., Any], *args: Any, wait: bool = True) -> Any:
        controller = self.cluster.actor("controller")
        ref = controller.drive.options(**self._options("controller")).remote(fn, self.cluster.actors("rollout"), *args)
        return self.cluster.wait(ref) if wait else None

    def hand_accelerator_to(self, role: Role) -> None:
        self.cluster.hand_accelerator_to(role)

    def sync_weights(self, policy_version: int) -> dict[str, float]:
        return self.cluster.sync_weights(policy_version)

    def replace_lost_rollout(self) -> bool:
        return self.cluster.replace_lost_rollout()

    def check_rollout_health(self) -> dict[str, float]:
        return check_and_replace(self.cluster)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.cluster.wait(self.cluster.actor("controller").log_metrics.remote(metrics, step))

    def open_trackers(self, first_step: int) -> None:
        self.cluster.wait(self.cluster.actor("controller").open_trackers.remote(first_step))

    def close_trackers(self) -> None:
        self.cluster.wait(self.cluster.actor("controller").close_trackers.remote())
