"""Ray actor shells over the engine's plain classes: a method per call the driver makes, nothing else.

Naming, placement and re-attaching are ``engine.cluster.workers``'s; ``engine.cluster.weight_sync``
drives the weight-transfer methods. Actors reserve no CPU (``num_cpus=0``): they mostly wait on each
other, and on a 2-core head reserved CPUs would starve the work; torch's thread count is set
explicitly instead (``cluster.torch_threads``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import ray
import torch

from trellis.engine.cluster.health import Heartbeat
from trellis.engine.cluster.remote_rollout import RemoteRollout
from trellis.engine.config import TrellisConfig
from trellis.engine.config.backends import backend_traits
from trellis.engine.devices import resolve_device, rollout_device, set_up_process
from trellis.engine.faults import fault_point
from trellis.engine.rollout.backends.registry import build_rollout_backend
from trellis.engine.rollout.backends.base import Generation, SamplingParams, in_order
from trellis.engine.rollout.production.controller import Controller
from trellis.engine.rollout.backends.pool import RolloutPool
from trellis.engine.run.identity import WorkerFingerprint
from trellis.engine.run.plan import resolve_total_steps
from trellis.engine.secrets import Credentials
from trellis.engine.storage.store import Store
from trellis.engine.storage.trackers import Trackers
from trellis.engine.train.fsdp import join_process_group
from trellis.engine.train.worker import TrainingWorker
from trellis.engine.weights.broadcast import (
    SENDER,
    GroupAddress,
    WeightGroup,
    free_address,
    rejoin,
)
from trellis.engine.weights.attestation import attests, bucket_checksums
from trellis.engine.weights.buckets import ROLLOUT_GPU_DTYPE, BucketLayout, flatten, layouts
from trellis.engine.weights.cuda_ipc import SharedWeights, WeightSender, gpu_identity, receive
from trellis.engine.weights.lora import AdapterMerger, adapter_merger


class BuiltFrom:
    """What every actor shell keeps: its name, the fingerprint it was built with, and the run's credentials."""

    _name: str = "a trellis worker"  # until its constructor runs

    def __init__(self, config: TrellisConfig, fingerprint: WorkerFingerprint, credentials: Credentials, side: str) -> None:
        self._name = ray.get_runtime_context().get_actor_name() or type(self).__name__
        self._fingerprint = fingerprint
        self._credentials = credentials
        self._attests = attests(config)  # weight syncs are attested: their checksums are taken on both sides
        credentials.apply()
        set_up_process(config, side)

    def __repr__(self) -> str:
        # Ray puts an actor's repr in the errors its calls raise, its constructor's too (and in its log
        # lines): the driver reads back from it which worker failed (``engine.cluster.failures``).
        return self._name

    def fingerprint(self) -> WorkerFingerprint:
        return self._fingerprint

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(worker, *args)`` on this shell's plain object: how every phase reaches a worker
        (``engine.run.phases``, through ``engine.cluster.ray_workers``), with no method per phase here."""
        return fn(self._target(), *args)

    def _target(self) -> Any:
        raise NotImplementedError

    def use_credentials(self, credentials: Credentials) -> None:
        """A later run's credentials replace those of the run that built this worker."""
        credentials.apply(replacing=self._credentials)
        self._credentials = credentials

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0)
class TrainerActor(BuiltFrom):
    """One rank of the run's trainer. With several ranks, the worker is built once every rank has
    joined the trainer group (``join_trainer_group``, called on all ranks at once).

    It is created beside the run's controller, not after it, so that the two processes start (most of
    it importing torch and transformers) at once; what the trainer needs of the controller (the
    dataset's size, for the total steps the schedule spans, and the pad token) it asks here."""

    def __init__(self, config: TrellisConfig, fingerprint: WorkerFingerprint, credentials: Credentials,
                 controller: ray.actor.ActorHandle, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(config, fingerprint, credentials, "train")
        self._config = config
        info: ControllerInfo = ray.get(controller.info.remote(), timeout=config.cluster.ray_get_timeout_s)
        # The total comes from this run's config: a re-attached run may extend the first one.
        self._build = dict(total_train_steps=resolve_total_steps(config, info.dataset_size), pad_token_id=info.pad_token_id)
        self.rank, self.world_size = rank, world_size
        self._device = resolve_device(config.train_worker.device)
        self._on_gpu = self._device.type == "cuda"
        self._sender: WeightSender | None = None
        self._weight_group: WeightGroup | None = None
        self._timeout_s = config.cluster.ray_get_timeout_s
        self._worker: TrainingWorker | None = None
        if world_size == 1:
            self._worker = TrainingWorker(config, **self._build)

    @property
    def worker(self) -> TrainingWorker:
        if self._worker is None:
            raise RuntimeError(f"Trainer rank {self.rank} of {self.world_size} has not joined its trainer group.")
        return self._worker

    def trainer_group_address(self) -> tuple[str, int]:
        """Where the trainer group meets: this (rank 0's) node, on a free port."""
        host = ray.util.get_node_ip_address()
        return host, free_address(host, "trainer", nccl=False).port

    def join_trainer_group(self, host: str, port: int) -> None:
        join_process_group(host, port, self.rank, self.world_size, self._device, self._timeout_s)
        self._worker = TrainingWorker(self._config, **self._build)

    def gpu_identity(self) -> str | None:
        return gpu_identity() if self._on_gpu else None

    def share_weights(self) -> SharedWeights:
        """CUDA IPC handles of the current weights (cast for the rollout); held until released."""
        fault_point("trainer.sync_weights")
        self.release_shared_weights()
        self._sender = WeightSender(self.worker.export_weights(), float_dtype=ROLLOUT_GPU_DTYPE)
        if self._attests:
            self.worker.sent_checksums = bucket_checksums(self._sender.tensors())
        return self._sender.shared()

    def release_shared_weights(self) -> None:
        if self._sender is not None:
            self._sender.release()
            self._sender = None

    def weight_group_address(self, key: str, nccl: bool, size: int) -> GroupAddress:
        """Where the weight group named ``key`` meets: the live group's address, or a new one."""
        if self._weight_group is not None and self._weight_group.address.key == key:
            return self._weight_group.address
        return free_address(ray.util.get_node_ip_address(), key, nccl=nccl, size=size)

    def join_weight_group(self, address: GroupAddress) -> None:
        self._weight_group = rejoin(self._weight_group, address, SENDER, self._timeout_s)

    def weight_layouts(self, float_dtype: torch.dtype) -> list[BucketLayout]:
        return layouts(self.worker.export_weights(), float_dtype=float_dtype)

    def broadcast_weights(self, float_dtype: torch.dtype) -> None:
        """Rank 0 sends to the weight group; the other ranks only help gather the full weights."""
        fault_point("trainer.sync_weights")
        weights = self.worker.export_weights()
        if self.rank == 0:
            group = self._weight_group
            buckets = flatten(weights, float_dtype=float_dtype, device=group.device)
            if self._attests:
                self.worker.sent_checksums = bucket_checksums({name: tensor for bucket in buckets for name, tensor in bucket.tensors()})
            group.send(buckets)

    def _target(self) -> TrainingWorker:
        return self.worker

    def export_adapter(self) -> dict[str, torch.Tensor]:
        """A LoRA policy's adapters on rank 0 (every rank must call it), for ``load_adapter``."""
        fault_point("trainer.sync_weights")
        adapter = self.worker.export_adapter()
        return self._sent({name: tensor.cpu() for name, tensor in adapter.items()}) if self.rank == 0 else {}

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0; every rank must call it (gathering shards is collective)."""
        fault_point("trainer.sync_weights")
        weights = self.worker.export_weights()
        return self._sent({name: tensor.cpu() for name, tensor in weights.items()}) if self.rank == 0 else {}

    def _sent(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._attests:
            self.worker.sent_checksums = bucket_checksums(weights)
        return weights

    def applied_step(self) -> int:
        return self.worker.applied_step

    def load_checkpoint(self, checkpoint: Store, load_optimizer: bool, load_scheduler: bool = True) -> int:
        return self.worker.load_checkpoint(checkpoint, load_optimizer=load_optimizer, load_scheduler=load_scheduler)

    def offload(self) -> None:
        self.worker.offload()

    def onload(self) -> None:
        self.worker.onload()

    def engine_may_stay_awake(self) -> bool:
        return self.worker.engine_may_stay_awake()


@ray.remote(num_cpus=0, concurrency_groups={"control": 1})
class RolloutActor(BuiltFrom):
    """``abort`` and ``resume_generation`` run in a group of their own: they must reach the backend
    while ``generate`` runs (a pause for weight sync interrupts it)."""

    def __init__(self, config: TrellisConfig, fingerprint: WorkerFingerprint, credentials: Credentials,
                 tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        super().__init__(config, fingerprint, credentials, "rollout")
        fault_point("rollout.start")
        self.backend = build_rollout_backend(config, AutoTokenizer.from_pretrained(tokenizer_path))
        self._config = config
        self._merger: AdapterMerger | None = None
        self._backend_name = config.rollout.backend
        self._on_gpu = rollout_device(config).type == "cuda"
        self._weight_group: WeightGroup | None = None
        self._timeout_s = config.cluster.ray_get_timeout_s
        self._generating = 0  # streams in progress

    def gpu_identity(self) -> str | None:
        return gpu_identity() if self._on_gpu else None

    def _target(self) -> Any:
        return self.backend

    def join_weight_group(self, address: GroupAddress, rank: int) -> None:
        self._weight_group = rejoin(self._weight_group, address, rank, self._timeout_s)

    def receive_weights(self, layouts: list[BucketLayout], policy_version: int) -> int:
        fault_point("rollout.sync_weights")
        self._load(self._weight_group.receive(layouts), policy_version)
        return policy_version

    def _load(self, weights: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Every sync's way in: what arrived is recorded (and held until attested), then loaded."""
        self.backend.load_weights(self.backend.intake.arrive(weights, policy_version, attested=self._attests), policy_version)

    def load_shared_weights(self, shared: SharedWeights, policy_version: int) -> int:
        fault_point("rollout.sync_weights")
        weights = receive(shared)
        self._load(weights, policy_version)
        torch.cuda.synchronize()  # the copies out of the trainer's buffers are done before it frees them
        del weights
        return policy_version

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> list[Generation]:
        return in_order(self.stream(prompts, params, limits), len(prompts))

    @ray.method(num_returns="streaming")
    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> Iterator[tuple[int, Generation]]:
        self._generating += 1  # what the heartbeat's stall clock watches
        self.backend.last_step_s = time.monotonic()
        try:
            yield from self.backend.stream(prompts, params, limits)
        finally:
            self._generating -= 1

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> Heartbeat:
        """The health check's probe (``engine.cluster.health``), answered beside a running generation."""
        stalled = time.monotonic() - self.backend.last_step_s if self._generating else 0.0
        return Heartbeat(pid=os.getpid(), generating=bool(self._generating), stalled_s=stalled)

    @ray.method(concurrency_group="control")
    def abort(self) -> None:
        self.backend.abort()

    @ray.method(concurrency_group="control")
    def resume_generation(self) -> None:
        self.backend.resume_generation()

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> int:
        fault_point("rollout.sync_weights")
        self._load(state_dict, policy_version)
        return policy_version

    def load_adapter(self, adapter: Mapping[str, torch.Tensor], policy_version: int) -> int:
        """A LoRA policy's adapters, merged here into the base this worker read from load_from."""
        fault_point("rollout.sync_weights")
        if self._merger is None:
            self._merger = adapter_merger(self._config)
        adapter = self.backend.intake.arrive(adapter, policy_version, attested=self._attests)
        self.backend.load_weights(self._merger.merged(adapter), policy_version)
        return policy_version

    def policy_version(self) -> int:
        return self.backend.policy_version

    def served_weights(self) -> dict[str, torch.Tensor]:
        """The weights the backend generates with, where it can hand them back (its registry entry says)."""
        if not backend_traits(self._backend_name).exports_served_weights:
            raise NotImplementedError(f"rollout.backend={self._backend_name} does not export the weights it serves.")
        return self.backend.served_weights()

    def offload(self) -> None:
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()


@dataclass(frozen=True)
class ControllerInfo:
    dataset_size: int
    pad_token_id: int
    train_report: str


@ray.remote(num_cpus=0, concurrency_groups={"records": 1})
class ControllerActor(BuiltFrom):
    """Produces, prepares, evaluates and stores batches; it keeps each batch by step (the phases name it).

    The run's metric trackers are written in a concurrency group of their own: ``log_step`` must
    not queue behind the next step's rollout, which ``start_rollout`` launched on this actor.
    """

    def __init__(self, config: TrellisConfig, fingerprint: WorkerFingerprint, credentials: Credentials) -> None:
        super().__init__(config, fingerprint, credentials, "rollout")
        self.config = config
        self.controller = Controller(config)
        self.trackers: Trackers | None = None

    def info(self) -> ControllerInfo:
        controller = self.controller
        return ControllerInfo(controller.dataset_size, controller.pad_token_id, controller.train_report.summary())

    def has_produced(self) -> bool:
        return self.controller.has_produced

    @ray.method(concurrency_group="records")
    def open_trackers(self, first_step: int) -> None:
        """The run's trackers live here, beside the workers, so that a step retried in another
        process finds them (and TensorBoard writes one event file per run start, not per step)."""
        if self.trackers is not None:
            self.trackers.close()
        self.trackers = Trackers(self.config, first_step)

    @ray.method(concurrency_group="records")
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.trackers is None:
            self.trackers = Trackers(self.config, first_step=step)
        self.trackers.log(metrics, step)

    @ray.method(concurrency_group="records")
    def close_trackers(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None

    def _target(self) -> Controller:
        return self.controller

    def drive(self, fn: Callable[..., Any], rollouts: list, *args: Any) -> Any:
        """``fn(controller, engines, *args)``: ``rollouts`` (the rollout actors) as one backend."""
        return fn(self.controller, self._rollout(rollouts), *args)

    def load_checkpoint(self, uri: str, load_dataset: bool) -> None:
        self.controller.load_checkpoint(uri, load_dataset=load_dataset)

    def _rollout(self, rollouts: list) -> RemoteRollout | RolloutPool:
        """The rollout workers as one backend: the worker itself, or a pool spreading groups over them."""
        timeout = self.config.cluster.ray_get_timeout_s
        engines = [RemoteRollout(handle, timeout) for handle in rollouts]
        return engines[0] if len(engines) == 1 else RolloutPool(engines)
