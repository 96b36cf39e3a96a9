"""The driver's handle on one run's workers: named Ray actors in the run's namespace, by role.

Every actor is detached, named ``{experiment_name}-{role}`` and created with ``get_if_exists``, so a
retried or resumed flow run re-attaches to live workers instead of rebuilding them, as long as they
were built from the same user code, trellis code and worker settings (``engine.run.identity``);
otherwise they are replaced. Each attach hands the workers the launching shell's credentials.
Handles are looked up by name on every use: a replaced worker keeps its name but not its handle.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError

from engine.cluster.actors import (
    ControllerActor,
    ControllerInfo,
    RolloutActor,
    TrainerActor,
)
from engine.cluster.environment import check_worker_environment, worker_runtime_env
from engine.cluster.placement import (
    gpu_requests,
    remove_side_placements,
    side_placement,
)
from engine.cluster.weight_sync import push_weights
from engine.config import TrellisConfig
from engine.run.code_bundle import CodeBundle, shipped_code
from engine.run.identity import WorkerFingerprint
from engine.run.plan import ROLES, Role, WorkerFacts, resolve_total_steps, roles_for
from engine.run.resume import StartPlan
from engine.secrets import Credentials

logger = logging.getLogger(__name__)
_ACTOR_CLASSES = {"controller": ControllerActor, "trainer": TrainerActor, "rollout": RolloutActor}


@dataclass(frozen=True)
class Launch:
    """What this driver builds workers with."""

    bundle: CodeBundle | None
    fingerprint: WorkerFingerprint
    credentials: Credentials


class RunWorkers:
    def __init__(self, config: TrellisConfig) -> None:
        self.config = config
        self.roles: tuple[Role, ...] = roles_for(config)
        self._timeout_s = config.cluster.ray_get_timeout_s

    @functools.cached_property
    def launch(self) -> Launch:
        bundle = shipped_code(self.config)
        credentials = Credentials.from_environment(self.config.cluster.forward_env)
        return Launch(bundle, WorkerFingerprint.of(self.config, bundle), credentials)

    def wait(self, refs: Any) -> Any:
        """``ray.get`` bounded by ``cluster.ray_get_timeout_s``."""
        return ray.get(refs, timeout=self._timeout_s)

    def name(self, role: Role) -> str:
        return f"{self.config.experiment_name}-{role}"

    def actor(self, role: Role) -> ActorHandle:
        """The live actor of ``role``; ``ValueError`` when there is none."""
        return ray.get_actor(self.name(role), namespace=self.config.ray_namespace)

    # -- lifecycle ----------------------------------------------------------------------------------

    def attach(self) -> WorkerFacts:
        """Get the run's actors, creating those that do not exist (or died) and replacing those built
        from other code or settings; report where they stand. A start that fails with no actor of the
        run left alive also gives back the run's placement groups, which would hold their devices."""
        try:
            return self._attach()
        except Exception:
            if self.config.disaggregated and not any(self._alive(role) for role in ROLES):
                remove_side_placements(self.config)
            raise

    def _alive(self, role: Role) -> bool:
        try:
            self.actor(role)
            return True
        except ValueError:  # no live actor of that name
            return False

    def _attach(self) -> WorkerFacts:
        check_worker_environment(self.config, self.launch.bundle, ray.get_runtime_context().gcs_address)
        self._retire_stale_workers()
        controller = self._get_or_create("controller")
        info: ControllerInfo = self.wait(controller.info.remote())
        # The total comes from this run's config: a re-attached run may extend the first one.
        total = resolve_total_steps(self.config, info.dataset_size)
        trainer = self._get_or_create("trainer", total, info.pad_token_id) if "trainer" in self.roles else None
        rollout = self._get_or_create("rollout", self.config.tokenizer_source) if "rollout" in self.roles else None
        applied = served = 0
        if trainer is not None:
            applied = self.wait(trainer.applied_step.remote())
        if rollout is not None:
            served = self.wait(rollout.policy_version.remote())
        if trainer is not None and rollout is not None and applied > 0 and served == 0:
            self._load_trainer_weights()  # a rollout worker re-created after a loss takes the trainer's weights
        rollout_gpu = self.wait(rollout.gpu_identity.remote()) if rollout is not None else None
        live = [actor for actor in (controller, trainer, rollout) if actor is not None]
        self.wait([actor.use_credentials.remote(self.launch.credentials) for actor in live])
        return WorkerFacts(
            dataset_size=info.dataset_size,
            pad_token_id=info.pad_token_id,
            train_report=info.train_report,
            applied_step=applied,
            holds_state=bool(applied or served or self.wait(controller.has_produced.remote())),
            rollout_on_gpu=rollout_gpu is not None,
        )

    def restore(self, start: StartPlan) -> None:
        """Bring the live workers to where ``start`` says the run begins."""
        if start.action == "restart":
            self.release()
            self.attach()
            return
        if start.checkpoint is None:
            return
        load = self.config.load_checkpoint_cfg
        waits = [self.actor("controller").load_checkpoint.remote(start.checkpoint, load.load_dataset)]
        if "trainer" in self.roles and start.action != "reattach":  # reattach: the trainer is already there
            options = self.config.storage_options
            waits.append(self.actor("trainer").load_checkpoint.remote(start.checkpoint, options, load.load_optimizer_states))
        self.wait(waits)
        if "trainer" in self.roles and "rollout" in self.roles:
            trainer, rollout = self.actor("trainer"), self.actor("rollout")
            applied, served = self.wait([trainer.applied_step.remote(), rollout.policy_version.remote()])
            if applied != served:
                self._load_trainer_weights()

    def release(self) -> None:
        """Kill the run's actors (those that exist) and give back their placement groups."""
        for role in ROLES:
            try:
                ray.kill(self.actor(role), no_restart=True)
            except ValueError:
                pass
        if self.config.disaggregated:
            remove_side_placements(self.config)

    def rollout_alive(self) -> bool:
        try:
            ray.get(self.actor("rollout").pid.remote(), timeout=min(30.0, self._timeout_s))
            return True
        except (ValueError, RayActorError, GetTimeoutError):  # ValueError: no live actor of that name
            return False

    def replace_lost_rollout(self) -> bool:
        """A retried task's first suspect: replace a dead rollout worker; returns whether one was."""
        if "rollout" not in self.roles or self.rollout_alive():
            return False
        self.restart_rollout()
        return True

    def restart_rollout(self) -> ActorHandle:
        """Replace the rollout worker and give it the trainer's current weights."""
        try:
            ray.kill(self.actor("rollout"), no_restart=True)
        except ValueError:
            pass  # already gone from the registry
        rollout = self._get_or_create("rollout", self.config.tokenizer_source)
        if "trainer" in self.roles:  # debug_rollout keeps the initial weights
            self._load_trainer_weights()
        return rollout

    def hand_accelerator_to(self, role: Role) -> None:
        """The colocated switch, as ``LocalRun.hand_accelerator_to``: the other side offloads first.
        Both calls return at once on CPU, and when the side already holds the accelerator."""
        if role not in self.roles or self.config.disaggregated:  # each side has devices of its own
            return
        giver: Role = "trainer" if role == "rollout" else "rollout"
        if giver in self.roles:  # debug modes run one side only
            try:
                self.wait(self.actor(giver).offload.remote())
            except (ValueError, RayActorError):
                if giver != "rollout":
                    raise  # a lost rollout worker holds no memory (produce_batch replaces it); a lost trainer is fatal
        self.wait(self.actor(role).onload.remote())

    def sync_weights(self, policy_version: int) -> str:
        """The trainer's weights into the rollout worker; returns the transport used."""
        return push_weights(self.config, self.actor("trainer"), self.actor("rollout"), policy_version)

    def pids(self) -> dict[Role, int]:
        """The process of each live worker (tests compare them across runs)."""
        return {role: self.wait(self.actor(role).pid.remote()) for role in self.roles}

    def _load_trainer_weights(self) -> None:
        """Give a (new) rollout worker the trainer's current weights, versioned by the trainer's step."""
        self.sync_weights(self.wait(self.actor("trainer").applied_step.remote()))

    def _retire_stale_workers(self) -> None:
        """Release the live workers when any was built from other code or settings than this run's."""
        for role in ROLES:
            try:
                built = self.wait(self.actor(role).fingerprint.remote())
            except (ValueError, RayActorError):  # none alive under that name
                continue
            differences = self.launch.fingerprint.differences(built)
            if differences:
                logger.warning(
                    "The live workers of %s differ from this run in %s: replacing them.",
                    self.config.experiment_name, " and ".join(differences),
                )
                self.release()
                return

    def _get_or_create(self, role: Role, *args: Any) -> ActorHandle:
        config, launch = self.config, self.launch
        options: dict[str, Any] = dict(
            name=self.name(role), namespace=config.ray_namespace, lifetime="detached", get_if_exists=True, max_concurrency=1
        )
        gpus = gpu_requests(config, ray.cluster_resources().get("GPU", 0.0)).get(role)
        if gpus:
            options["num_gpus"] = gpus
        if config.disaggregated:
            options["scheduling_strategy"] = side_placement(config, role, self._timeout_s)
        runtime_env = worker_runtime_env(config, launch.bundle, role)
        if runtime_env:
            options["runtime_env"] = runtime_env
        return _ACTOR_CLASSES[role].options(**options).remote(config, launch.fingerprint, launch.credentials, *args)
