"""Weights from the trainer actor to the rollout actor, driven from the flow's side: which transport
their placement and ``cluster.weight_sync`` call for, and the calls to both actors that run it."""

from __future__ import annotations

import ray
import torch

from engine.config import TrellisConfig
from engine.weights.buckets import ROLLOUT_GPU_DTYPE


def push_weights(config: TrellisConfig, trainer, rollout, policy_version: int) -> str:
    """Trainer weights into the rollout worker with no disk round trip. Returns the transport used
    (``cluster.weight_sync`` chooses): CUDA IPC when both are on the same GPU, a broadcast in a
    process group of their own (NCCL) when they are on different GPUs, and otherwise (CPU) Ray's
    object store, or a gloo broadcast when asked for."""
    timeout = config.cluster.ray_get_timeout_s
    trainer_gpu, rollout_gpu = ray.get([trainer.gpu_identity.remote(), rollout.gpu_identity.remote()], timeout=timeout)
    transport = weight_transport(config.cluster.weight_sync, trainer_gpu, rollout_gpu)
    if transport == "object_store":
        ray.get(rollout.load_weights.remote(trainer.export_weights.remote(), policy_version), timeout=timeout)
    elif transport == "cuda_ipc":
        try:
            ray.get(rollout.load_shared_weights.remote(trainer.share_weights.remote(), policy_version), timeout=timeout)
        finally:
            ray.get(trainer.release_shared_weights.remote(), timeout=timeout)
    else:
        _broadcast_weights(config, trainer, rollout, policy_version, nccl=transport == "nccl", rollout_on_gpu=rollout_gpu is not None)
    return transport


def weight_transport(choice: str, trainer_gpu: str | None, rollout_gpu: str | None) -> str:
    """``cuda_ipc``, ``nccl``, ``gloo`` or ``object_store`` for workers on these GPUs (None: on CPU)."""
    both_on_gpus = trainer_gpu is not None and rollout_gpu is not None
    if both_on_gpus and trainer_gpu == rollout_gpu:
        return "cuda_ipc"  # NCCL cannot pair two processes on one GPU, and IPC copies nothing twice
    if choice == "broadcast":
        return "nccl" if both_on_gpus else "gloo"
    if choice == "auto" and both_on_gpus:
        return "nccl"
    return "object_store"


def _broadcast_weights(config: TrellisConfig, trainer, rollout, policy_version: int, *, nccl: bool, rollout_on_gpu: bool) -> None:
    timeout = config.cluster.ray_get_timeout_s
    trainer_pid, rollout_pid = ray.get([trainer.pid.remote(), rollout.pid.remote()], timeout=timeout)
    key = f"trellis-weights-{trainer_pid}-{rollout_pid}"  # a restarted worker is a new process: a new group
    address = ray.get(trainer.weight_group_address.remote(key, nccl), timeout=timeout)
    ray.get([trainer.join_weight_group.remote(address), rollout.join_weight_group.remote(address)], timeout=timeout)
    dtype = ROLLOUT_GPU_DTYPE if rollout_on_gpu else torch.float32  # a CPU rollout runs in the trainer's float32
    layouts = ray.get(trainer.weight_layouts.remote(dtype), timeout=timeout)
    ray.get(
        [trainer.broadcast_weights.remote(dtype), rollout.receive_weights.remote(layouts, policy_version)], timeout=timeout
    )
