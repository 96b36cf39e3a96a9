"""Who leaves the GPU at a colocated hand-over: the trainer while the rollout runs
(``train_worker.offload_when_idle``), the rollout engine while the trainer trains (``rollout.sleep_level``).

Moving the weights and AdamW state to the CPU and back costs two host transfers of ~12 bytes a parameter
every step; XTuner's colocated trainer always pays them, TRL's and verl's default trainers never do.
``auto`` pays them only where the GPU cannot hold the trainer and the rollout engine at once. It decides
at every hand-over to the rollout, from what the device has free then (the trainer's activations already
given back, the engine asleep): the trainer stays when the engine's share of the GPU
(``rollout.gpu_memory_utilization`` for vLLM) fits in that free memory with a margin. A backend without a
fixed share (transformers generating on the GPU) always gets the GPU to itself, as before.

The engine's sleep and wake cost every step too; TRL's colocated engine never sleeps. With
``rollout.sleep_level: auto`` the engine sleeps through the first fit, which shows how much memory a fit
takes beyond what the trainer holds (its peak reserved by torch); from then on, at every hand-over to the
trainer, the engine stays awake where the device's free memory holds that with a margin.
"""

from __future__ import annotations

import logging

import torch

from trellis.engine.config import TrellisConfig
from trellis.engine.config.backends import backend_traits

logger = logging.getLogger(__name__)

# Of the GPU's memory, kept free beyond the engine's share: what its wake-up maps on top of its share
# (vLLM's allocator rounds to 2 MiB granules, CUDA graph pools) and what the step's other allocations need.
HEADROOM = 0.04
# Of a fit's measured need, asked beyond it before the engine stays awake through the next fit: packs hold
# at most pack_max_length tokens, so fits differ little, but a padded row grows with its longest sample.
FIT_MARGIN = 0.25


def rollout_share(config: TrellisConfig) -> float | None:
    """The fraction of its GPU the colocated rollout engine takes when it wakes; None where it has no fixed
    one. An engine that never sleeps (``rollout.sleep_level: 0``) already holds its share: 0. Under ``auto``
    the share counts whether or not the engine stayed awake: where it did, the free memory read already lacks
    it, and the trainer stays only with room for it twice (safe, and true for a trainer that fits easily)."""
    if config.disaggregated or not backend_traits(config.rollout.backend).reserves_gpu_share:
        return None
    return 0.0 if config.rollout.sleep_level == 0 else config.rollout.gpu_memory_utilization


def asks_engine_awake(config: TrellisConfig) -> bool:
    """Whether the trainer is asked, at each hand-over to it, if the engine may stay awake: under
    ``rollout.sleep_level: auto``, beside an engine with a fixed share of the GPU."""
    return config.rollout.sleep_level == "auto" and rollout_share(config) is not None


def stays_on_gpu(setting: bool | str, *, free_bytes: int, total_bytes: int, share: float | None) -> bool:
    """Whether the trainer keeps its weights and optimizer state on the GPU while the rollout runs.
    ``setting``: ``train_worker.offload_when_idle``; ``free_bytes``: what the device has free now, the
    trainer's own memory still held."""
    if setting != "auto":
        return not setting
    if share is None:
        return False
    return free_bytes >= (share + HEADROOM) * total_bytes


def engine_stays_awake(*, free_bytes: int, total_bytes: int, fit_need_bytes: int | None, packs_filled: float = 1.0) -> bool:
    """Whether the next fit fits beside the awake rollout engine: ``fit_need_bytes`` is what the last fits
    reserved beyond the trainer's memory now (None before the first fit: the engine sleeps through it), and
    ``packs_filled`` how full their micro-batches were (tokens over pack_max_length): a fit of fuller ones,
    as responses grow, needs up to 1 / packs_filled times as much for its activations."""
    if fit_need_bytes is None:
        return False
    return free_bytes >= fit_need_bytes / packs_filled * (1 + FIT_MARGIN) + HEADROOM * total_bytes


class IdleMemory:
    """A trainer's side of the colocated hand-over: where its weights and optimizer state wait while the
    rollout runs, decided at every ``offload``, and whether the engine may stay awake through the next fit,
    answered at every hand-over to the trainer; each said in the log when it changes."""

    def __init__(self, config: TrellisConfig, device: torch.device) -> None:
        self._setting = config.train_worker.offload_when_idle
        self._share = rollout_share(config)
        self._asks_engine_awake = asks_engine_awake(config)
        self._device = device
        self.stays_on_gpu: bool | None = None  # the last decision; None before the first, and on the CPU
        self.engine_awake: bool | None = None  # the last answer of ``engine_may_stay_awake``
        self._fit_peak: int | None = None  # the most torch reserved during a fit, over the fits so far
        self._packs_filled = 0.0  # the fullest micro-batches of those fits, as a share of pack_max_length

    def offload(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Gives the memory the last fit cached (its activations: tens of GB for a 7B model) back to the
        GPU, then moves the weights and optimizer state to CPU unless they stay. A no-op on the CPU."""
        if self._device.type != "cuda":
            return
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self._device)
        stays = stays_on_gpu(self._setting, free_bytes=free, total_bytes=total, share=self._share)
        if self._setting == "auto" and stays != self.stays_on_gpu:
            share = "no fixed share of it" if self._share is None else f"{self._share:.0%} of it"
            logger.info("The trainer %s the GPU while the rollout runs: %.1f of %.1f GiB free, the rollout engine takes %s.",
                        "keeps its weights and optimizer state on" if stays else "moves its weights and optimizer state off",
                        free / 2**30, total / 2**30, share)
        self.stays_on_gpu = stays
        if not stays:
            move_training_state(policy, optimizer, torch.device("cpu"))
            torch.cuda.empty_cache()

    def fit_ended(self, packs_filled: float) -> float | None:
        """After a fit, before its peak memory statistics are reset, with how full its micro-batches were on
        average (tokens over pack_max_length); returns whether the engine stayed awake through it (1.0 or
        0.0; None where it is never asked to)."""
        if self._device.type != "cuda":
            return None
        self._fit_peak = max(self._fit_peak or 0, torch.cuda.max_memory_reserved(self._device))
        self._packs_filled = max(self._packs_filled, min(packs_filled, 1.0))
        return None if self.engine_awake is None else float(self.engine_awake)

    def engine_may_stay_awake(self) -> bool:
        """Asked at the hand-over to the trainer, before the engine would sleep: whether the next fit fits
        beside it, as the last fits measured. False on the CPU, for an engine without a fixed share, and
        where ``rollout.sleep_level`` is not auto."""
        if self._device.type != "cuda" or not self._asks_engine_awake:
            return False
        free, total = torch.cuda.mem_get_info(self._device)
        need = None if self._fit_peak is None else max(0, self._fit_peak - torch.cuda.memory_reserved(self._device))
        awake = engine_stays_awake(free_bytes=free, total_bytes=total, fit_need_bytes=need, packs_filled=self._packs_filled)
        if need is not None and awake != self.engine_awake:
            logger.info("The rollout engine %s while the trainer trains: %.1f of %.1f GiB free, a fit took %.1f GiB more "
                        "with its micro-batches %.0f%% full.", "stays awake" if awake else "sleeps", free / 2**30, total / 2**30,
                        need / 2**30, 100 * self._packs_filled)
        self.engine_awake = awake
        return awake

    def onload(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._device.type != "cpu":
            move_training_state(policy, optimizer, self._device)


def move_training_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    policy.to(device)  # the FSDP root, which re-registers its sharded parameters after the move
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
