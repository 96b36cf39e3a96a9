"""Ray actor shells over the engine's plain classes: they add placement and naming, nothing else.

Every actor is named inside the run's namespace and created with ``get_if_exists``, so a retried or
resumed flow run re-attaches to live workers instead of rebuilding them. Actors reserve no CPU
(``num_cpus=0``): they mostly wait on each other, and on a 2-core head reserved CPUs would starve
the work; torch's thread count is set explicitly instead. On a cluster with GPUs the trainer and
rollout actors ask for a share of one (``gpu_requests``); ``engine.weight_sync`` moves weights
between them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from engine.config import TrellisConfig
from engine.controller import Controller
from engine.local_run import build_rollout_backend, resolve_total_steps, rollout_device, seed_everything
from engine.prepare import PreparedBatch
from engine.produce import ProduceResult, produce_summary
from engine.rollout.base import Generation, SamplingParams
from engine.secrets import install_log_redaction
from engine.train_worker import FitResult, TrainingWorker, resolve_device
from engine.weight_broadcast import RECEIVER, SENDER, GroupAddress, WeightGroup, free_address, rejoin
from engine.weight_sync import push_weights
from engine.weight_transport import (
    ROLLOUT_GPU_DTYPE,
    BucketLayout,
    SharedWeights,
    WeightSender,
    flatten,
    gpu_identity,
    layouts,
    receive,
)


class GpuPlacementError(RuntimeError):
    pass


def _set_up_process(config: TrellisConfig) -> None:
    torch.set_num_threads(config.cluster.torch_threads or os.cpu_count() or 1)
    seed_everything(config.seed, config.deterministic)
    install_log_redaction(config.storage_options)


@ray.remote(num_cpus=0)
class TrainerActor:
    def __init__(self, config: TrellisConfig, total_train_steps: int, pad_token_id: int) -> None:
        _set_up_process(config)
        self.worker = TrainingWorker(config, total_train_steps=total_train_steps, pad_token_id=pad_token_id)
        self._on_gpu = resolve_device(config.train_worker.device).type == "cuda"
        self._sender: WeightSender | None = None
        self._weight_group: WeightGroup | None = None
        self._timeout_s = config.cluster.ray_get_timeout_s

    def gpu_identity(self) -> str | None:
        return gpu_identity() if self._on_gpu else None

    def share_weights(self) -> SharedWeights:
        """CUDA IPC handles of the current weights (cast for the rollout); held until released."""
        self.release_shared_weights()
        self._sender = WeightSender(self.worker.export_weights(), float_dtype=ROLLOUT_GPU_DTYPE)
        return self._sender.shared()

    def release_shared_weights(self) -> None:
        if self._sender is not None:
            self._sender.release()
            self._sender = None

    def weight_group_address(self, key: str, nccl: bool) -> GroupAddress:
        """Where the weight group named ``key`` meets: the live group's address, or a new one."""
        if self._weight_group is not None and self._weight_group.address.key == key:
            return self._weight_group.address
        return free_address(ray.util.get_node_ip_address(), key, nccl=nccl)

    def join_weight_group(self, address: GroupAddress) -> None:
        self._weight_group = rejoin(self._weight_group, address, SENDER, self._timeout_s)

    def weight_layouts(self, float_dtype: torch.dtype) -> list[BucketLayout]:
        return layouts(self.worker.export_weights(), float_dtype=float_dtype)

    def broadcast_weights(self, float_dtype: torch.dtype) -> None:
        group = self._weight_group
        group.send(flatten(self.worker.export_weights(), float_dtype=float_dtype, device=group.device))

    def fit(self, batch: PreparedBatch, step: int) -> FitResult:
        return self.worker.fit(batch, step)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.cpu() for name, tensor in self.worker.export_weights().items()}

    def applied_step(self) -> int:
        return self.worker.applied_step

    def save_checkpoint(self, uri: str, storage_options: Mapping[str, Any], save_optimizer: bool) -> None:
        self.worker.save_checkpoint(uri, storage_options, save_optimizer=save_optimizer)

    def load_checkpoint(self, uri: str, storage_options: Mapping[str, Any], load_optimizer: bool) -> int:
        return self.worker.load_checkpoint(uri, storage_options, load_optimizer=load_optimizer)

    def export_hf(self, uri: str, storage_options: Mapping[str, Any], tokenizer_source: str) -> None:
        self.worker.export_hf(uri, storage_options, tokenizer_source)

    def offload(self) -> None:
        self.worker.offload()

    def onload(self) -> None:
        self.worker.onload()

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class RolloutActor:
    def __init__(self, config: TrellisConfig, tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        _set_up_process(config)
        self.backend = build_rollout_backend(config, AutoTokenizer.from_pretrained(tokenizer_path))
        self._on_gpu = rollout_device(config).type == "cuda"
        self._weight_group: WeightGroup | None = None
        self._timeout_s = config.cluster.ray_get_timeout_s

    def gpu_identity(self) -> str | None:
        return gpu_identity() if self._on_gpu else None

    def join_weight_group(self, address: GroupAddress) -> None:
        self._weight_group = rejoin(self._weight_group, address, RECEIVER, self._timeout_s)

    def receive_weights(self, layouts: list[BucketLayout], policy_version: int) -> int:
        self.backend.load_weights(self._weight_group.receive(layouts), policy_version)
        return policy_version

    def load_shared_weights(self, shared: SharedWeights, policy_version: int) -> int:
        weights = receive(shared)
        self.backend.load_weights(weights, policy_version)
        torch.cuda.synchronize()  # the copies out of the trainer's buffers are done before it frees them
        del weights
        return policy_version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        return self.backend.generate(prompts, params)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> int:
        self.backend.load_weights(state_dict, policy_version)
        return policy_version

    def policy_version(self) -> int:
        return self.backend.policy_version

    def offload(self) -> None:
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()

    def pid(self) -> int:
        return os.getpid()


class RemoteRollout:
    """The rollout contract over a rollout actor, so the controller's code runs unchanged."""

    def __init__(self, handle, timeout_s: float) -> None:
        self._handle = handle
        self._timeout_s = timeout_s
        self._version = ray.get(handle.policy_version.remote(), timeout=timeout_s)

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        return ray.get(self._handle.generate.remote(prompts, params), timeout=self._timeout_s)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        ray.get(self._handle.load_weights.remote(state_dict, policy_version), timeout=self._timeout_s)

    def offload(self) -> None:
        ray.get(self._handle.offload.remote(), timeout=self._timeout_s)

    def onload(self) -> None:
        ray.get(self._handle.onload.remote(), timeout=self._timeout_s)


@ray.remote(num_cpus=0)
class ControllerActor:
    """Produces, prepares, evaluates and stores batches; batches stay in the object store."""

    def __init__(self, config: TrellisConfig) -> None:
        _set_up_process(config)
        self.config = config
        self.controller = Controller(config)

    def info(self) -> dict[str, int]:
        return {"dataset_size": self.controller.dataset_size, "pad_token_id": self.controller.pad_token_id}

    def has_produced(self) -> bool:
        return self.controller.has_produced

    def train_report(self) -> str:
        return self.controller.train_report.summary()

    @ray.method(num_returns=2)
    def produce_batch(self, step: int, rollout) -> tuple[dict[str, float], ProduceResult]:
        produced = self.controller.produce_batch(step, RemoteRollout(rollout, self.config.cluster.ray_get_timeout_s))
        return produce_summary(produced), produced

    @ray.method(num_returns=2)
    def load_batch(self, step: int) -> tuple[dict[str, float], ProduceResult]:
        produced = self.controller.load_batch(step)
        return produce_summary(produced), produced

    def save_checkpoint(self, uri: str) -> None:
        self.controller.save_checkpoint(uri)

    def load_checkpoint(self, uri: str, load_dataset: bool) -> None:
        self.controller.load_checkpoint(uri, load_dataset=load_dataset)

    @ray.method(num_returns=2)
    def prepare_data(self, produced: ProduceResult, step: int) -> tuple[dict[str, float], PreparedBatch]:
        batch = self.controller.prepare_data(produced.groups, step)
        return batch.info, batch

    def write_trajectories(self, produced: ProduceResult, step: int, split: str) -> str:
        return self.controller.write_trajectories(produced.groups, step, split)[0]

    def evaluate(self, step: int, rollout) -> tuple[str, dict[str, float]]:
        groups, metrics = self.controller.evaluate(step, RemoteRollout(rollout, self.config.cluster.ray_get_timeout_s))
        uri, _ = self.controller.write_trajectories(groups, step, "eval")
        return uri, metrics

    def pid(self) -> int:
        return os.getpid()


@dataclass
class Workers:
    controller: ray.actor.ActorHandle
    trainer: ray.actor.ActorHandle | None  # None in debug_rollout
    rollout: ray.actor.ActorHandle | None  # None in debug_train
    total_train_steps: int
    pad_token_id: int


def roles(config: TrellisConfig) -> tuple[str, ...]:
    """The workers a run needs: debug_rollout starts no trainer, debug_train no rollout worker."""
    if config.debug_rollout:
        return ("controller", "rollout")
    if config.debug_train:
        return ("controller", "trainer")
    return ("controller", "trainer", "rollout")


def _names(config: TrellisConfig) -> dict[str, str]:
    return {role: f"{config.experiment_name}-{role}" for role in ("controller", "trainer", "rollout")}


def gpu_requests(config: TrellisConfig, cluster_gpus: float) -> dict[str, float]:
    """The GPU fraction each role asks Ray for. On a cluster with GPUs, device ``auto`` means the
    trainer takes one, and the rollout follows it (vLLM always needs one); by default the GPU workers
    split one GPU, colocated, as XTuner's colocated trainer does."""
    device = config.train_worker.device
    trainer_gpu = device == "cuda" or (device == "auto" and cluster_gpus > 0)
    wants = []
    if "trainer" in roles(config) and trainer_gpu:
        wants.append("trainer")
    if "rollout" in roles(config) and (config.rollout.backend == "vllm" or trainer_gpu):
        wants.append("rollout")
    if wants and cluster_gpus <= 0:
        raise GpuPlacementError(
            f"The {' and '.join(wants)} worker(s) need a GPU (train_worker.device={device}, "
            f"rollout.backend={config.rollout.backend}), but the Ray cluster offers none. Start the cluster on a "
            "GPU machine, or use train_worker.device: cpu with rollout.backend: transformers."
        )
    share = config.cluster.gpu_share or (1.0 / len(wants) if wants else 0.0)
    return {role: share for role in wants}


def _get_or_create(actor_class, role: str, config: TrellisConfig, *args):
    options: dict[str, Any] = dict(
        name=_names(config)[role], namespace=config.ray_namespace, lifetime="detached", get_if_exists=True, max_concurrency=1
    )
    gpus = gpu_requests(config, ray.cluster_resources().get("GPU", 0.0)).get(role)
    if gpus:
        options["num_gpus"] = gpus
    if role == "rollout" and config.rollout.runtime_env:
        options["runtime_env"] = config.rollout.runtime_env
    return actor_class.options(**options).remote(config, *args)


def attach_workers(config: TrellisConfig) -> Workers:
    """Get the run's named actors, creating those that do not exist (or died)."""
    timeout = config.cluster.ray_get_timeout_s
    controller = _get_or_create(ControllerActor, "controller", config)
    info = ray.get(controller.info.remote(), timeout=timeout)
    # The total comes from the config of this flow run: a re-attached run may extend the first one.
    total = resolve_total_steps(config, info["dataset_size"])
    needed = roles(config)
    trainer = rollout = None
    if "trainer" in needed:
        trainer = _get_or_create(TrainerActor, "trainer", config, total, info["pad_token_id"])
    if "rollout" in needed:
        rollout = _get_or_create(RolloutActor, "rollout", config, config.tokenizer_source)
    if trainer is not None and rollout is not None:
        applied, served = ray.get([trainer.applied_step.remote(), rollout.policy_version.remote()], timeout=timeout)
        if applied > 0 and served == 0:  # a rollout worker re-created after a loss takes the trainer's weights
            _load_trainer_weights(config, trainer, rollout)
    return Workers(controller, trainer, rollout, total, info["pad_token_id"])


def workers_used(config: TrellisConfig, workers: Workers) -> bool:
    """Whether any live worker holds run state: trained or synced weights, or drawn prompts."""
    calls = [workers.controller.has_produced.remote()]
    if workers.trainer is not None:
        calls.append(workers.trainer.applied_step.remote())
    if workers.rollout is not None:
        calls.append(workers.rollout.policy_version.remote())
    return any(ray.get(calls, timeout=config.cluster.ray_get_timeout_s))


def lookup(config: TrellisConfig, role: str) -> ray.actor.ActorHandle:
    """Handle of one of the run's live actors by role (controller, trainer, rollout); cheap."""
    return ray.get_actor(_names(config)[role], namespace=config.ray_namespace)


def rollout_alive(config: TrellisConfig) -> bool:
    try:
        ray.get(lookup(config, "rollout").pid.remote(), timeout=min(30.0, config.cluster.ray_get_timeout_s))
        return True
    except (ValueError, RayActorError, GetTimeoutError):  # ValueError: no live actor of that name
        return False


def restart_rollout(config: TrellisConfig) -> ray.actor.ActorHandle:
    """Replace a dead rollout worker and give it the trainer's current weights."""
    try:
        ray.kill(lookup(config, "rollout"), no_restart=True)
    except ValueError:
        pass  # already gone from the registry
    rollout = _get_or_create(RolloutActor, "rollout", config, config.tokenizer_source)
    if "trainer" in roles(config):  # debug_rollout keeps the initial weights
        _load_trainer_weights(config, lookup(config, "trainer"), rollout)
    return rollout


def restore_checkpoint(config: TrellisConfig, uri: str, *, reattach: bool) -> None:
    """Load a checkpoint into the run's live workers. ``reattach``: the trainer is already at that
    checkpoint, so only the controller (prompt order, RNG) is restored."""
    timeout = config.cluster.ray_get_timeout_s
    load = config.load_checkpoint_cfg
    waits = [lookup(config, "controller").load_checkpoint.remote(uri, load.load_dataset)]
    if "trainer" in roles(config) and not reattach:
        trainer = lookup(config, "trainer")
        waits.append(trainer.load_checkpoint.remote(uri, config.storage_options, load.load_optimizer_states))
    ray.get(waits, timeout=timeout)
    if "trainer" in roles(config) and "rollout" in roles(config):
        trainer, rollout = lookup(config, "trainer"), lookup(config, "rollout")
        applied, served = ray.get([trainer.applied_step.remote(), rollout.policy_version.remote()], timeout=timeout)
        if applied != served:
            _load_trainer_weights(config, trainer, rollout)


def _load_trainer_weights(config: TrellisConfig, trainer, rollout) -> None:
    """Give a (new) rollout worker the trainer's current weights, versioned by the trainer's step."""
    step = ray.get(trainer.applied_step.remote(), timeout=config.cluster.ray_get_timeout_s)
    push_weights(config, trainer, rollout, step)


def hand_accelerator_to(config: TrellisConfig, role: str) -> None:
    """The colocated switch, as ``LocalRun.hand_accelerator_to``: the other side offloads first. Both
    calls return at once on CPU, and when the side already holds the accelerator."""
    present = roles(config)
    if role not in present:
        return
    timeout = config.cluster.ray_get_timeout_s
    giver = "trainer" if role == "rollout" else "rollout"
    if giver in present:  # debug modes run one side only
        try:
            ray.get(lookup(config, giver).offload.remote(), timeout=timeout)
        except (ValueError, RayActorError):
            if giver != "rollout":
                raise  # a lost rollout worker holds no memory (produce_batch replaces it); a lost trainer is fatal
    ray.get(lookup(config, role).onload.remote(), timeout=timeout)


def release_workers(config: TrellisConfig) -> None:
    """Kill the run's actors (those that exist)."""
    for name in _names(config).values():
        try:
            ray.kill(ray.get_actor(name, namespace=config.ray_namespace), no_restart=True)
        except ValueError:
            pass

