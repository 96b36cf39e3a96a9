"""The run's workers by role, however they run: the ``Workers`` interface the phases
(``engine.run.phases``) are written against, and its in-process implementation.

A phase hands the workers a plain function and its arguments; the function runs on the worker's plain
object (``Controller``, ``TrainingWorker``, a rollout backend) as ``fn(worker, *args)``: here by a
direct call, on a cluster (``engine.cluster.ray_workers``) as one generic actor method per worker.
The fan-out to every trainer rank or rollout engine is written once, in each implementation of ``run``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from trellis.engine.config import TrellisConfig
from trellis.engine.rollout.backends.base import RolloutBackend
from trellis.engine.rollout.production.controller import Controller
from trellis.engine.run.attested_sync import attested_sync
from trellis.engine.run.plan import Role
from trellis.engine.storage.trackers import Trackers
from trellis.engine.train.worker import TrainingWorker
from trellis.engine.weights.attestation import attests, bucket_checksums
from trellis.engine.weights.lora import AdapterMerger, adapter_merger, sends_adapters


@dataclass(frozen=True)
class Call:
    """``fn(worker, *args)`` on every worker of ``role``."""

    role: Role
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


class Workers(Protocol):
    roles: tuple[Role, ...]

    def run(self, *calls: Call) -> list[list[Any]]:
        """Every call on every worker of its role, all at once; each call's results in worker order."""
        ...

    def keep(self, role: Role, fn: Callable[..., tuple[Any, Any]], *args: Any) -> tuple[Any, Any]:
        """``fn`` on the first worker of ``role`` returns (small, large): the small part comes back, the large
        stays where it is (an object-store reference on a cluster) for the next phase to hand on."""
        ...

    def drive(self, fn: Callable[..., Any], *args: Any, wait: bool = True) -> Any:
        """``fn(controller, engines, *args)`` on the controller, ``engines`` being the rollout engines as one
        backend; ``wait=False`` launches it and returns at once."""
        ...

    def named(self, phase: str) -> Workers:
        """The same workers, their calls named after ``phase`` (a worker's failure says in which phase)."""
        ...

    def hand_accelerator_to(self, role: Role) -> None: ...
    def sync_weights(self, policy_version: int) -> dict[str, float]: ...
    def replace_lost_rollout(self) -> bool: ...
    def check_rollout_health(self) -> dict[str, float]: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def open_trackers(self, first_step: int) -> None: ...
    def close_trackers(self) -> None: ...


def each(workers: Workers, role: Role, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(worker, *args)`` on every worker of ``role``; their results in order."""
    return workers.run(Call(role, fn, args))[0]


class LocalWorkers:
    """The workers as plain objects of this process: one controller, at most one trainer and one engine."""

    def __init__(
        self, config: TrellisConfig, roles: tuple[Role, ...], controller: Controller, trainer: TrainingWorker | None,
        backend: RolloutBackend | None, trackers: Trackers | None,
    ) -> None:
        self.config, self.roles = config, roles
        self.controller, self.trainer, self.backend, self.trackers = controller, trainer, backend, trackers
        self._merger: AdapterMerger | None = None

    def _of(self, role: Role) -> list[Any]:
        return [{"controller": self.controller, "trainer": self.trainer, "rollout": self.backend}[role]]

    def run(self, *calls: Call) -> list[list[Any]]:
        return [[call.fn(worker, *call.args) for worker in self._of(call.role)] for call in calls]

    def keep(self, role: Role, fn: Callable[..., tuple[Any, Any]], *args: Any) -> tuple[Any, Any]:
        return fn(self._of(role)[0], *args)

    def drive(self, fn: Callable[..., Any], *args: Any, wait: bool = True) -> Any:
        """Nothing runs beside it here: a launched rollout is produced now (and kept for its step)."""
        return fn(self.controller, self.backend, *args)

    def named(self, phase: str) -> LocalWorkers:
        return self  # a failure here raises where it happens, in the phase's own traceback

    def hand_accelerator_to(self, role: Role) -> None:
        """The colocated switch: the other side offloads first (both calls do nothing on CPU, and
        nothing when the side already holds the accelerator); the engine stays awake where the trainer's
        fit fits beside it (``rollout.sleep_level: auto``)."""
        if self.trainer is None or self.backend is None or self.config.disaggregated:
            return
        if role == "rollout":
            self.trainer.offload()
            self.backend.onload()
        elif role == "trainer":
            if not self.trainer.engine_may_stay_awake():
                self.backend.offload()
            self.trainer.onload()

    def sync_weights(self, policy_version: int) -> dict[str, float]:
        """Weights go to the rollout engine while its KV cache sleeps, with no disk round trip; a LoRA
        policy's adapters alone, which the engine merges into its base (``engine.weights.lora``). Attested
        as on a cluster (``engine.weights.attestation``); returns the attestation's metrics."""
        return attested_sync(self.config, policy_version, lambda: self._push(policy_version), self.run_calls, self.hand_accelerator_to,
                             shares_accelerator=True)

    def _push(self, policy_version: int) -> None:
        attested = attests(self.config)
        if sends_adapters(self.config, "in_process"):
            if self._merger is None:
                self._merger = adapter_merger(self.config)
            sent = self.trainer.export_adapter()
        else:
            sent = self.trainer.export_weights()
        if attested:
            self.trainer.sent_checksums = bucket_checksums(sent)
        arrived = self.backend.intake.arrive(sent, policy_version, attested=attested)
        if self._merger is not None:
            arrived = self._merger.merged(arrived)
        self.backend.load_weights(arrived, policy_version=policy_version)

    def run_calls(self, *calls: tuple[Role, Callable[..., Any], tuple]) -> list[list[Any]]:
        return [[fn(worker, *args) for worker in self._of(role)] for role, fn, args in calls]

    def replace_lost_rollout(self) -> bool:
        return False  # an engine of this process is not lost without the process

    def check_rollout_health(self) -> dict[str, float]:
        """The engine of this process lives as long as the process, and nothing generates between steps."""
        return {"health/engines": 1.0, "health/replaced_engines": 0.0, "health/hung_engines": 0.0}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.trackers is not None:
            self.trackers.log(metrics, step)

    def open_trackers(self, first_step: int) -> None:
        """The trackers again from ``first_step`` (the metrics past it are written anew); none when not tracking."""
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = Trackers(self.config, first_step)

    def close_trackers(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None
