"""What each rollout backend a config can name needs from the machine: one table, read wherever a
decision depends on the backend (the device it runs on, the GPUs a worker asks Ray for, the rules of
a colocated run), so that adding a backend adds a row here and a builder in ``engine.rollout.backends``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from engine.config.sections import RolloutConfig


@dataclass(frozen=True)
class RolloutBackendTraits:
    needs_gpu: bool  # runs only on an accelerator (vLLM); otherwise on the trainer's device
    serves_weights: bool  # exports the weights it generates with, by the trainer's names (check_weights reads them)


ROLLOUT_BACKENDS: dict[str, RolloutBackendTraits] = {
    "transformers": RolloutBackendTraits(needs_gpu=False, serves_weights=True),
    "vllm": RolloutBackendTraits(needs_gpu=True, serves_weights=False)  # its own fused layout,
}


def backend_traits(name: str) -> RolloutBackendTraits:
    try:
        return ROLLOUT_BACKENDS[name]
    except KeyError:
        raise ValueError(f"Unknown rollout backend {name!r}; trellis has {', '.join(sorted(ROLLOUT_BACKENDS))}.") from None


def configurable_backends() -> set[str]:
    """The names ``rollout.backend`` accepts."""
    return set(get_args(RolloutConfig.model_fields["backend"].annotation))
