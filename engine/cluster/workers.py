"""The driver's handle on one run's workers: named Ray actors in the run's namespace, by role.

Every actor is detached, named ``{experiment_name}-{role}`` (``-{role}-{k}`` for the k-th trainer rank
or rollout worker past the first) and created with ``get_if_exists``, so a
retried or resumed flow run re-attaches to live workers instead of rebuilding them, as long as they
were built from the same user code, trellis code and worker settings (``engine.run.identity``);
otherwise they are replaced. Each attach hands the workers the launching shell's credentials.
Handles are looked up by name on every use: a replaced worker keeps its name but not its handle.

Several trainer ranks form one torch.distributed group: when any rank is lost, all are rebuilt (the
group cannot take a new member) and the run resumes from its last checkpoint. Rollout workers are
independent: a lost one is replaced alone and given the trainer's weights.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from trellis.engine.cluster.actors import (
    ControllerActor,
    ControllerInfo,
    RolloutActor,
    TrainerActor,
)
from trellis.engine.cluster.actor_gpus import gpus_of, on_gpus
from trellis.engine.cluster.environment import check_worker_environment, worker_runtime_env
from trellis.engine.cluster.failures import worker_error
from trellis.engine.cluster.placement import (
    Placement,
    decide_placement,
    placement_strategy,
    remove_side_placements,
)
from trellis.engine.cluster.weight_sync import push_weights
from trellis.engine.config import TrellisConfig
from trellis.engine.errors import WorkerLostError
from trellis.engine.run.attested_sync import attested_sync
from trellis.engine.run.code_bundle import CodeBundle, shipped_code
from trellis.engine.run.run_log import run_log_for
from trellis.engine.run.identity import WorkerFingerprint
from trellis.engine.run.plan import ROLES, Role, WorkerFacts, roles_for
from trellis.engine.run.resume import StartPlan
from trellis.engine.secrets import Credentials
from trellis.engine.storage.store import Store
from trellis.engine.train.idle_memory import asks_engine_awake
from trellis.engine.weights.attestation import attests, held

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
        self.transport = ""  # of the last weight sync (``engine.cluster.weight_sync``)

    @functools.cached_property
    def launch(self) -> Launch:
        bundle = shipped_code(self.config)
        for source in bundle.module_sources if bundle is not None else ():
            run_log_for(self.config).info(f"{source}: imported from outside the launch folder, shipped to the workers (py_modules)")
        credentials = Credentials.from_environment(self.config.cluster.forward_env)
        return Launch(bundle, WorkerFingerprint.of(self.config, bundle), credentials)

    @functools.cached_property
    def placement(self) -> Placement:
        """Where this run's workers go: decided here, once, from the config and the cluster."""
        return decide_placement(self.config, ray.cluster_resources())

    def wait(self, refs: Any) -> Any:
        """``ray.get`` bounded by ``cluster.ray_get_timeout_s``; for a list, the first failure is raised
        as soon as it happens (a lost trainer rank must not leave the driver waiting on the others,
        which wait for it in a collective). A worker's failure is raised as a ``WorkerError`` that
        names the worker (``engine.cluster.failures``)."""
        try:
            return self._get(refs)
        except (RayTaskError, RayActorError) as error:
            raise worker_error(error, self) from error

    def _get(self, refs: Any) -> Any:
        if not isinstance(refs, list) or len(refs) < 2:
            return ray.get(refs, timeout=self._timeout_s)
        deadline = time.monotonic() + self._timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise GetTimeoutError(f"{len(pending)} of {len(refs)} calls gave no result within {self._timeout_s:g}s.")
            ray.get(ready)  # raises the call's error
        return ray.get(refs)

    def count(self, role: Role) -> int:
        if role == "trainer":
            return self.config.train_resources.num_workers
        if role == "rollout":
            return self.config.rollout_resources.num_workers
        return 1

    def names(self, role: Role) -> list[str]:
        base = f"{self.config.experiment_name}-{role}"
        return [base] + [f"{base}-{index}" for index in range(1, self.count(role))]

    def name(self, role: Role) -> str:
        return self.names(role)[0]

    def actor(self, role: Role) -> ActorHandle:
        """The live actor of ``role`` (its first: trainer rank 0); ``WorkerLostError`` (a ``ValueError``)
        when there is none."""
        return self._lookup(self.name(role))

    def actors(self, role: Role) -> list[ActorHandle]:
        """Every live actor of ``role`` (trainer ranks in order); ``WorkerLostError`` when one is missing."""
        return [self._lookup(name) for name in self.names(role)]

    def _lookup(self, name: str) -> ActorHandle:
        try:
            return ray.get_actor(name, namespace=self.config.ray_namespace)
        except ValueError as error:  # no live actor of that name; Ray's words stay in the run log's traceback
            raise WorkerLostError(f"{self.label(name)} was lost: no live worker of that name") from error

    def label(self, name: str) -> str:
        """How messages name the actor called ``name``: ``trainer rank 1 (exp-trainer-1)``."""
        for role in ROLES:
            names = self.names(role)
            if name in names:
                index = names.index(name)
                kind = {"controller": "the controller", "trainer": f"trainer rank {index}", "rollout": f"rollout worker {index}"}[role]
                return f"{kind} ({name})"
        return name

    def lost(self) -> list[str]:
        """The names of this run's workers that no longer run."""
        return [name for role in self.roles for name in self.names(role) if not self._named_alive(name)]

    # -- lifecycle ----------------------------------------------------------------------------------

    def attach(self) -> WorkerFacts:
        """Get the run's actors, creating those that do not exist (or died) and replacing those built
        from other code or settings; report where they stand. A start that fails ends the actors it
        created (a controller that cannot start leaves the workers started beside it), and with no actor
        of the run left alive it also gives back the run's placement groups, which would hold their
        devices. A worker lost or failing meanwhile is named (``WorkerError``), as in ``wait``."""
        created: list[str] = []
        try:
            return self._attach(created)
        except Exception as error:
            self._kill(created)
            if not any(self._alive(role) for role in ROLES):
                remove_side_placements(self.config)
            if isinstance(error, (RayTaskError, RayActorError)):
                raise worker_error(error, self) from error
            raise

    def _alive(self, role: Role) -> bool:
        return any(self._named_alive(name) for name in self.names(role))

    def _named_alive(self, name: str) -> bool:
        try:
            ray.get_actor(name, namespace=self.config.ray_namespace)
            return True
        except ValueError:  # no live actor of that name
            return False

    def _attach(self, created: list[str]) -> WorkerFacts:
        """``created`` gets the names of the actors this start creates, before it creates them."""
        check_worker_environment(self.config, self.launch.bundle, ray.get_runtime_context().gcs_address)
        self._retire_stale_workers()
        if "trainer" in self.roles:
            self._end_incomplete_trainer_group()
        created += self.lost()  # the workers that do not run now are those this start creates
        # Every role's actors are asked for at once: a new worker's process spends seconds importing
        # torch and transformers before its constructor runs, and those starts overlap.
        controller = self._get_or_create("controller", 0)
        rollouts = []
        if "rollout" in self.roles:
            rollouts = [self._get_or_create("rollout", index, self.config.tokenizer_source) for index in range(self.count("rollout"))]
        trainers = []
        if "trainer" in self.roles:
            world = self.count("trainer")
            trainers = [self._get_or_create("trainer", rank, controller, rank, world) for rank in range(world)]
        new_group = len(trainers) > 1 and self.name("trainer") in created  # a new group joins before use
        info: ControllerInfo = self.wait(controller.info.remote())  # a controller that cannot start is named first
        if new_group:
            host, port = self.wait(trainers[0].trainer_group_address.remote())
            self.wait([rank.join_trainer_group.remote(host, port) for rank in trainers])
        applied = self.wait(trainers[0].applied_step.remote()) if trainers else 0
        served = self.wait([r.policy_version.remote() for r in rollouts]) if rollouts else [0]
        if trainers and rollouts and ((applied > 0 and min(served) == 0) or self._unattested()):
            # a rollout worker re-created after a loss takes the trainer's weights; one left holding
            # weights whose attestation failed takes them again
            self._load_trainer_weights()
        rollout_gpu = gpus_of(rollouts[:1], self._timeout_s)[0] if rollouts else None
        train_gpu = gpus_of(trainers[:1], self._timeout_s)[0] if trainers else None
        live = [controller, *trainers, *rollouts]
        self.wait([actor.use_credentials.remote(self.launch.credentials) for actor in live])
        return WorkerFacts(
            dataset_size=info.dataset_size,
            pad_token_id=info.pad_token_id,
            train_report=info.train_report,
            applied_step=applied,
            holds_state=bool(applied or max(served) or self.wait(controller.has_produced.remote())),
            rollout_on_gpu=rollout_gpu is not None,
            train_on_gpu=train_gpu is not None,
        )

    def _end_incomplete_trainer_group(self) -> None:
        """Kill what is left of a trainer group with a rank missing, to rebuild it whole: its ranks wait in
        collectives for the lost one, and a torch.distributed group takes no new member."""
        names = self.names("trainer")
        if not all(self._named_alive(name) for name in names):
            self._kill(names)

    def _kill(self, names: list[str]) -> None:
        """Kill the named actors and wait until their names are free for new ones."""
        for name in names:
            try:
                ray.kill(ray.get_actor(name, namespace=self.config.ray_namespace), no_restart=True)
            except ValueError:
                pass
        deadline = time.monotonic() + min(60.0, self._timeout_s)
        while any(self._named_alive(name) for name in names) and time.monotonic() < deadline:
            time.sleep(0.2)

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
            checkpoint = Store(start.checkpoint, self.config.storage_options)
            waits += [t.load_checkpoint.remote(checkpoint, load.load_optimizer_states, load.load_scheduler) for t in self.actors("trainer")]
        self.wait(waits)
        if "trainer" in self.roles and "rollout" in self.roles:
            applied = self.wait(self.actor("trainer").applied_step.remote())
            served = self.wait([r.policy_version.remote() for r in self.actors("rollout")])
            if any(version != applied for version in served) or self._unattested():
                self._load_trainer_weights()

    def release(self) -> None:
        """Kill the run's actors (every rank and worker, also those of an earlier config with more) and
        give back their placement groups."""
        prefix = f"{self.config.experiment_name}-"
        names = [
            entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == self.config.ray_namespace and entry["name"].startswith(prefix)
            and entry["name"][len(prefix):].split("-")[0] in ROLES
        ]
        self._kill(names)
        remove_side_placements(self.config)

    def rollout_alive(self) -> bool:
        """Whether every rollout worker answers."""
        return not self._lost_rollouts()

    def _lost_rollouts(self) -> list[int]:
        lost = []
        for index, name in enumerate(self.names("rollout")):
            try:
                handle = ray.get_actor(name, namespace=self.config.ray_namespace)
                ray.get(handle.pid.remote(), timeout=min(30.0, self._timeout_s))
            except (ValueError, RayActorError, GetTimeoutError):  # ValueError: no live actor of that name
                lost.append(index)
        return lost

    def replace_lost_rollout(self) -> bool:
        """A retried task's first suspect: replace the dead rollout workers; returns whether any was."""
        if "rollout" not in self.roles:
            return False
        lost = self._lost_rollouts()
        if lost:
            self.restart_rollout(lost)
        return bool(lost)

    def restart_rollout(self, indices: list[int] | None = None, *, load_weights: bool = True) -> ActorHandle:
        """Replace rollout workers (all by default) and give them the trainer's current weights (unless
        a weight sync follows anyway); returns the first replaced."""
        indices = list(range(self.count("rollout"))) if indices is None else indices
        self._kill([self.names("rollout")[index] for index in indices])
        replaced = [self._get_or_create("rollout", index, self.config.tokenizer_source) for index in indices]
        if load_weights and "trainer" in self.roles:  # debug_rollout keeps the initial weights
            self._load_trainer_weights()
        return replaced[0]

    def hand_accelerator_to(self, role: Role) -> None:
        """The colocated switch, as ``LocalRun.hand_accelerator_to``: the other side offloads first.
        Only actors on a GPU are called (on CPU there is nothing to move); a side that already holds
        the accelerator returns at once. The engines stay awake where every trainer's fit fits beside them."""
        if role not in self.roles or self.config.disaggregated:  # each side has devices of its own
            return
        giver: Role = "trainer" if role == "rollout" else "rollout"
        # debug modes run one side only
        if giver in self.roles and not (giver == "rollout" and self._engines_may_stay_awake()):
            try:
                self.wait([actor.offload.remote() for actor in on_gpus(self.actors(giver), self._timeout_s)])
            except (ValueError, RayActorError):
                if giver != "rollout":
                    raise  # a lost rollout worker holds no memory (produce_batch replaces it); a lost trainer is fatal
        self.wait([actor.onload.remote() for actor in on_gpus(self.actors(role), self._timeout_s)])

    def _engines_may_stay_awake(self) -> bool:
        """Every trainer rank's fit fits beside its awake engine (``rollout.sleep_level: auto``); else all sleep."""
        if not asks_engine_awake(self.config) or "trainer" not in self.roles:
            return False
        trainers = on_gpus(self.actors("trainer"), self._timeout_s)
        return bool(trainers) and all(self.wait([actor.engine_may_stay_awake.remote() for actor in trainers]))

    def sync_weights(self, policy_version: int) -> dict[str, float]:
        """The trainer's weights into every rollout worker, attested (``engine.weights.attestation``):
        every sync, those of a restart or a replaced worker too. Returns the attestation's metrics;
        ``transport`` says how the weights went."""

        def push() -> None:
            try:
                self.transport = push_weights(self.config, self.actors("trainer"), self.actors("rollout"), policy_version)
            except (RayTaskError, RayActorError) as error:
                raise worker_error(error, self) from error

        shared = attests(self.config) and not self.config.disaggregated and gpus_of(self.actors("trainer")[:1], self._timeout_s)[0] is not None
        return attested_sync(self.config, policy_version, push, self.run_calls, self.hand_accelerator_to, shares_accelerator=shared)

    def run_calls(self, *calls: tuple[Role, Callable[..., Any], tuple], phase: str | None = None) -> list[list[Any]]:
        """Each ``(role, fn, args)`` as ``fn(worker, *args)`` on every worker of its role, all at once (the
        first failure raised); per call, the workers' results in order. ``phase`` names the calls
        (``trainer.fit``) for failures and Ray's dashboard."""
        groups = [
            [actor.call.options(**({"name": f"{role}.{phase}"} if phase else {})).remote(fn, *args) for actor in self.actors(role)]
            for role, fn, args in calls
        ]
        flat = iter(self.wait([ref for group in groups for ref in group]))
        return [[next(flat) for _ in group] for group in groups]

    def pids(self) -> dict[Role, int]:
        """The process of each live worker (the first of each role; tests compare them across runs)."""
        return {role: self.wait(self.actor(role).pid.remote()) for role in self.roles}

    def _unattested(self) -> bool:
        """Whether a rollout worker still holds weights whose attestation failed (its step failed)."""
        return attests(self.config) and any(self.run_calls(("rollout", held, ()))[0])

    def _load_trainer_weights(self) -> None:
        """Give (new) rollout workers the trainer's current weights, versioned by the trainer's step."""
        self.sync_weights(self.wait(self.actor("trainer").applied_step.remote()))

    def _retire_stale_workers(self) -> None:
        """Release the live workers when any was built from other code or settings than this run's."""
        for role in ROLES:
            try:
                built = self.wait(self.actor(role).fingerprint.remote())
            except (ValueError, RayActorError, GetTimeoutError):  # none alive (or answering) under that name
                continue
            differences = self.launch.fingerprint.differences(built)
            if differences:
                logger.warning(
                    "The live workers of %s differ from this run in %s: replacing them.",
                    self.config.experiment_name, " and ".join(differences),
                )
                self.release()
                return

    def _get_or_create(self, role: Role, index: int, *args: Any) -> ActorHandle:
        """The ``index``-th actor of ``role`` (a trainer rank, a rollout worker), created if missing."""
        config, launch = self.config, self.launch
        options: dict[str, Any] = dict(
            name=self.names(role)[index], namespace=config.ray_namespace, lifetime="detached", get_if_exists=True,
            max_concurrency=1,
        )
        gpus = self.placement.gpus.get(role)
        if gpus:
            options["num_gpus"] = gpus
        strategy = placement_strategy(config, self.placement, role, index, self._timeout_s)
        if strategy is not None:
            options["scheduling_strategy"] = strategy
        runtime_env = worker_runtime_env(config, launch.bundle, role)
        if runtime_env:
            options["runtime_env"] = runtime_env
        return _ACTOR_CLASSES[role].options(**options).remote(config, launch.fingerprint, launch.credentials, *args)
