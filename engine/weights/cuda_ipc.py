"""Trainer weights to a rollout worker in another process on the same GPU, through CUDA IPC.

The trainer casts its weights into buckets (``engine.weights.buckets``) and shares a CUDA IPC handle
for each. The rollout process maps the same memory and hands views of it to its engine, which copies
them into its own parameters. Nothing passes through host memory or Ray's object store. The sender
keeps the buffers alive until the receiver is done with them (``WeightSender.release``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.multiprocessing.reductions import reduce_tensor

from trellis.engine.weights.buckets import Bucket, TensorSpec, flatten

_DEVICE_ARG = 6  # position of the CUDA device index among rebuild_cuda_tensor's arguments


@dataclass(frozen=True)
class SharedWeights:
    """What crosses the process boundary: per bucket, an IPC handle of its buffer and its layout."""

    buckets: list[tuple[Any, list[TensorSpec]]]


class WeightSender:
    """Holds the shared buffers on the trainer's side until ``release``."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], *, float_dtype: torch.dtype) -> None:
        # On this process's GPU even when the weights are offloaded to host memory.
        device = torch.device("cuda", torch.cuda.current_device())
        self._buckets = flatten(state_dict, float_dtype=float_dtype, device=device)
        torch.cuda.current_stream().synchronize()  # the copies are done before anyone maps the memory

    def tensors(self) -> dict[str, torch.Tensor]:
        """The shared weights by name, as the receiver will see them."""
        return {name: tensor for bucket in self._buckets for name, tensor in bucket.tensors()}

    def shared(self) -> SharedWeights:
        return SharedWeights([(reduce_tensor(bucket.flat), bucket.specs) for bucket in self._buckets])

    def release(self) -> None:
        self._buckets = []
        torch.cuda.ipc_collect()  # frees the buffers once the receiver's references are gone


def receive(shared: SharedWeights) -> dict[str, torch.Tensor]:
    """Views of the sender's buffers, by name; drop them once copied so the sender can free them."""
    weights: dict[str, torch.Tensor] = {}
    device = torch.cuda.current_device()
    for (rebuild, args), specs in shared.buckets:
        args = list(args)
        args[_DEVICE_ARG] = device
        weights.update(Bucket(rebuild(*args), specs).tensors())
    return weights


def gpu_identity() -> str | None:
    """The UUID of this process's current GPU (None without one): IPC needs both sides on the same card."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
