"""A cheap fingerprint of a model's weights, to check after a sync that the rollout serves the trainer's:
per tensor, its size and three sums in float64 (plain, absolute, and position-weighted, which sees a
permutation the other two miss). Each side computes its own; only these numbers cross the wire.

A side that holds a tensor in 16 bits (the rollout casts to bf16 on a GPU) rounds each value by up to
2^-8 of it, so its sums may move by that much of the absolute sum: the tolerance follows the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

_FULL_TOLERANCE = 1e-6  # float32 on both sides: the sums differ only by the order of additions
_HALF_TOLERANCE = 2.0**-7  # a 16-bit side rounds each value by at most 2^-8 of it


@dataclass(frozen=True)
class TensorPrint:
    numel: int
    total: float
    absolute: float
    weighted: float  # sum of value x (index % 7 + 1)
    half: bool  # held in 16 bits


class WeightMismatchError(RuntimeError):
    """The rollout serves other weights than the trainer's after a sync."""


def fingerprint(weights: Mapping[str, torch.Tensor]) -> dict[str, TensorPrint]:
    prints = {}
    with torch.no_grad():
        for name, tensor in weights.items():
            values = tensor.detach().reshape(-1).to(torch.float64)
            ramp = torch.arange(values.numel(), device=values.device, dtype=torch.int64) % 7 + 1
            prints[name] = TensorPrint(
                numel=values.numel(),
                total=float(values.sum()),
                absolute=float(values.abs().sum()),
                weighted=float((values * ramp).sum()),
                half=tensor.element_size() <= 2,
            )
    return prints


def largest_difference(trainer: Mapping[str, TensorPrint], served: Mapping[str, TensorPrint], *, engine: str) -> float:
    """The largest difference of the sums, relative to the absolute sum; ``WeightMismatchError`` naming
    the tensors past their tolerance (or missing, or of another size)."""
    wrong, largest = [], 0.0
    for name in sorted(trainer.keys() | served.keys()):
        mine, theirs = trainer.get(name), served.get(name)
        if mine is None or theirs is None or mine.numel != theirs.numel:
            wrong.append(f"{name} ({'missing on the rollout' if theirs is None else 'not on the trainer' if mine is None else 'another size'})")
            continue
        scale = max(mine.absolute, theirs.absolute, 1e-12)
        difference = max(abs(mine.total - theirs.total), abs(mine.absolute - theirs.absolute), abs(mine.weighted - theirs.weighted) / 7)
        relative = difference / scale
        largest = max(largest, relative)
        if relative > (_HALF_TOLERANCE if mine.half or theirs.half else _FULL_TOLERANCE):
            wrong.append(f"{name} (relative difference {relative:.3g})")
    if wrong:
        shown = ", ".join(wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        raise WeightMismatchError(f"After the weight sync, {engine} serves other weights than the trainer's: {shown}.")
    return largest
