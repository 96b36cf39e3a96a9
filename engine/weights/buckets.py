"""Weights as a few flat buffers ("buckets"), one dtype each: what every transport between a trainer
and a rollout engine moves (CUDA IPC on one GPU, a broadcast between devices). A receiver learns the
layouts (names, shapes, offsets) first and allocates its buffers before the data arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

BUCKET_BYTES = 512 << 20
# What the rollout side runs in on a GPU (both backends); weights are cast to it before sharing.
ROLLOUT_GPU_DTYPE = torch.bfloat16


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
