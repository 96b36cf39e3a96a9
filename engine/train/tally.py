"""What one update reports: metric sums kept on the device during the micro-batch loop, then the
mini-batch metrics (loss, clip fractions, entropy, train/rollout mismatch, importance weights) and
their average over a step; and the learning-rate schedule."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from trellis.engine.algo.losses import mismatch_sums
from trellis.engine.data.prepare import TrainSequence


def lr_factor(step: int, *, warmup: int, total: int, kind: str, min_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


class Tally:
    """Metric sums, maxima and minima of a mini-batch, kept on the device until it ends so that the
    micro-batch loop never waits for the GPU (each ``float()`` of a GPU value would)."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._maxima: dict[str, torch.Tensor] = {}
        self._minima: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def max(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self._maxima[name] = torch.maximum(self._maxima[name], value) if name in self._maxima else value

    def min(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self._minima[name] = torch.minimum(self._minima[name], value) if name in self._minima else value

    def values(self, *, reduce_over_ranks: bool = False) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """All three as floats, read back from the device at once; with ``reduce_over_ranks``, summed,
        maximised and minimised over the ranks of the default process group first."""
        if reduce_over_ranks:
            self._reduce_over_ranks()
        tables = (self._sums, self._maxima, self._minima)
        out: tuple[dict[str, float], ...] = (defaultdict(float), {}, {})
        entries = [(which, name, value) for which, table in enumerate(tables) for name, value in table.items()]
        if entries:
            numbers = torch.stack([value for _, _, value in entries]).tolist()
            for (which, name, _), number in zip(entries, numbers):
                out[which][name] = number
        return out


    def _reduce_over_ranks(self) -> None:
        tables = (self._sums, self._maxima, self._minima)
        names: list[list[set[str]]] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(names, [set(table) for table in tables])
        device = next((v.device for table in tables for v in table.values()), torch.device("cpu"))
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        empty = (0.0, -math.inf, math.inf)  # what a rank without a value adds
        for which, (table, op) in enumerate(zip(tables, (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN))):
            keys = sorted(set().union(*(rank_names[which] for rank_names in names)))
            if not keys:
                continue
            stacked = torch.stack([table[k].to(device) if k in table else torch.tensor(empty[which], device=device) for k in keys])
            dist.all_reduce(stacked, op=op)
            table.update(zip(keys, stacked.unbind()))


def split_evenly(sequences: list[TrainSequence], parts: int) -> list[list[TrainSequence]]:
    size = math.ceil(len(sequences) / parts)
    return [sequences[i : i + size] for i in range(0, len(sequences), size)]


def mini_batch_metrics(sums, maxima, minima, tokens: float, grad_norm: float, lr: float) -> dict[str, float]:
    tokens = max(tokens, 1.0)
    metrics = {
        "pg_loss": sums["pg_loss"],
        "grad_norm": grad_norm,
        "lr": lr,
        "entropy": sums["entropy_sum"] / tokens,
        "clipfrac_low": sums["clipped_low"] / tokens,
        "clipfrac_high": sums["clipped_high"] / tokens,
        "clipfrac": (sums["clipped_low"] + sums["clipped_high"]) / tokens,
    }
    if "dual_clipped" in sums:
        metrics["dual_clipfrac"] = sums["dual_clipped"] / tokens
    if "kl" in sums:
        metrics["kl"] = sums["kl"]
    metrics["mismatch/k3_kl"] = sums["mismatch/k3_kl"] / tokens
    metrics["mismatch/abs_logprob_diff"] = sums["mismatch/abs_logprob_diff"] / tokens
    metrics["mismatch/abs_logprob_diff_max"] = maxima["mismatch/abs_logprob_diff_max"]
    metrics["mismatch/train_ppl"] = math.exp(sums["mismatch/train_nll"] / tokens)
    metrics["mismatch/rollout_ppl"] = math.exp(sums["mismatch/rollout_nll"] / tokens)
    metrics["entropy/rollout"] = sums["mismatch/rollout_nll"] / tokens  # sampled-token NLL estimates entropy
    if "router/aux_loss" in sums:
        metrics["router/aux_loss"] = sums["router/aux_loss"]
    if "rollout_is/weight_sum" in sums:
        metrics["rollout_is/mean"] = sums["rollout_is/weight_sum"] / tokens
        metrics["rollout_is/max"] = maxima["rollout_is/max"]
        metrics["rollout_is/min"] = minima["rollout_is/min"]
        metrics["rollout_is/rejected_fraction"] = sums["rollout_is/rejected"] / tokens
    return metrics


def average(mini_batches: list[dict[str, float]]) -> dict[str, float]:
    keys = mini_batches[0].keys() if mini_batches else []
    return {key: sum(m[key] for m in mini_batches) / len(mini_batches) for key in keys}


def record_token_stats(record: Tally, counts: dict[str, torch.Tensor], entropy: torch.Tensor, old_logprobs: torch.Tensor,
                       rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """A micro-batch's clip counts, entropy and train/rollout mismatch sums."""
    for name, value in counts.items():
        record.add(name, value)
    record.add("entropy_sum", entropy.sum())
    for name, value in mismatch_sums(old_logprobs, rollout_logprobs, mask).items():
        if name.endswith("_max"):
            record.max(f"mismatch/{name}", value)
        else:
            record.add(f"mismatch/{name}", value)
