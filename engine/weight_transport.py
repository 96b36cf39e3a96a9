"""Trainer weights to a rollout worker in another process on the same GPU, through CUDA IPC.

The trainer casts its weights into a few flat buffers (one per bucket) and shares a CUDA IPC handle
for each. The rollout process maps the same memory and hands views of it to its engine, which
copies them into its own parameters. Nothing passes through host memory or Ray's object store.
The sender keeps the buffers alive until the receiver is done with them (``WeightSender.release``).
The same buckets carry weights between devices in ``engine.weight_broadcast``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch.multiprocessing.reductions import reduce_tensor

BUCKET_BYTES = 512 << 20
# What the rollout side runs in on a GPU (both backends); weights are cast to it before sharing.
ROLLOUT_GPU_DTYPE = torch.bfloat16
_DEVICE_ARG = 6  # position of the CUDA device index among rebuild_cuda_tensor's arguments


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements of the bucket's flat buffer


@dataclass
class Bucket:
    flat: torch.Tensor  # 1-D; every tensor of the bucket has its dtype
    specs: list[TensorSpec]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self.specs:
            yield spec.name, self.flat[spec.offset : spec.offset + math.prod(spec.shape)].view(spec.shape)


@dataclass(frozen=True)
class BucketLayout:
    """A bucket without its data: what a receiver allocates before the data arrives."""

    dtype: torch.dtype
    numel: int
    specs: list[TensorSpec]

    def allocate(self, device: torch.device) -> Bucket:
        return Bucket(torch.empty(self.numel, dtype=self.dtype, device=device), self.specs)


def flatten(
    state_dict: Mapping[str, torch.Tensor],
    *,
    float_dtype: torch.dtype,
    device: torch.device,
    bucket_bytes: int = BUCKET_BYTES,
) -> list[Bucket]:
    """Copy the tensors into flat buffers on ``device`` of at most ``bucket_bytes`` each (one tensor
    may exceed it), floating-point ones cast to ``float_dtype``; a bucket holds one dtype."""
    buckets = []
    for dtype, group in _groups(state_dict, float_dtype, bucket_bytes):
        bucket = _layout(dtype, group).allocate(device)
        for (_, tensor), (_, view) in zip(group, bucket.tensors()):
            view.copy_(tensor.detach())
        buckets.append(bucket)
    return buckets


def layouts(state_dict: Mapping[str, torch.Tensor], *, float_dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES) -> list[BucketLayout]:
    """The layouts of the buckets ``flatten`` makes of the same arguments, without copying anything."""
    return [_layout(dtype, group) for dtype, group in _groups(state_dict, float_dtype, bucket_bytes)]


def _groups(state_dict: Mapping[str, torch.Tensor], float_dtype: torch.dtype, bucket_bytes: int):
    groups: list[tuple[torch.dtype, list[tuple[str, torch.Tensor]]]] = []
    size = 0
    for name, tensor in state_dict.items():
        dtype = float_dtype if tensor.is_floating_point() else tensor.dtype
        bytes_ = tensor.numel() * dtype.itemsize
        if not groups or groups[-1][0] != dtype or size + bytes_ > bucket_bytes:
            groups.append((dtype, []))
            size = 0
        groups[-1][1].append((name, tensor))
        size += bytes_
    return groups


def _layout(dtype: torch.dtype, group: list[tuple[str, torch.Tensor]]) -> BucketLayout:
    specs, offset = [], 0
    for name, tensor in group:
        specs.append(TensorSpec(name, tuple(tensor.shape), offset))
        offset += tensor.numel()
    return BucketLayout(dtype, offset, specs)


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
