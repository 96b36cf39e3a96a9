"""Which device each side of a run computes on, and the per-process setup every worker shares."""

from __future__ import annotations

import os
import random

import torch

from trellis.engine.config import TrellisConfig
from trellis.engine.config.backends import backend_traits
from trellis.engine.errors import SettingError
from trellis.engine.secrets import install_log_redaction


def resolve_device(choice: str) -> torch.device:
    """``auto``: the GPU where there is one, else the CPU."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def rollout_device(config: TrellisConfig) -> torch.device:
    """A backend that needs a GPU (vLLM) runs there; the transformers loop on the trainer's device."""
    if backend_traits(config.rollout.backend).needs_gpu:
        return torch.device("cuda")
    return resolve_device(config.train_worker.device)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def worker_threads(config: TrellisConfig, side: str | None = None) -> int:
    """torch threads of a worker: ``cluster.torch_threads``, else ``TRELLIS_TORCH_THREADS`` where the
    worker runs (a machine whose cores several runs share at once, as the test suite's), else, for a
    side of a disaggregated run on CPU, the CPUs that side holds (the two sides compute at the same
    time), else every core."""
    if config.cluster.torch_threads:
        return config.cluster.torch_threads
    threads = os.environ.get("TRELLIS_TORCH_THREADS", "")
    if threads:
        if not threads.isdigit() or int(threads) < 1:
            raise SettingError(f"TRELLIS_TORCH_THREADS={threads!r}: give a whole number of threads, 1 or more.")
        return int(threads)
    if config.disaggregated and side is not None and resolve_device(config.train_worker.device).type == "cpu":
        resources = config.train_resources if side == "train" else config.rollout_resources
        return max(1, int(resources.accelerators_per_worker))
    return os.cpu_count() or 1


def set_up_process(config: TrellisConfig, side: str | None = None) -> None:
    """What every process that holds a part of a run does first: torch threads, seeds, log redaction."""
    torch.set_num_threads(worker_threads(config, side))
    seed_everything(config.seed, config.deterministic)
    install_log_redaction(config.storage_options)
