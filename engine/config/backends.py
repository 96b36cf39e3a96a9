"""What each rollout backend a config can name needs and can do: one table, read wherever a decision
depends on the backend (the device it runs on, the GPUs a worker asks Ray for, the rules of a colocated
or a disaggregated run, what a rollout worker can hand back), so that adding a backend adds a row here
and a builder in ``engine.rollout.backends.registry``, and no code asks for a backend by its name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from trellis.engine.config.sections import RolloutConfig


@dataclass(frozen=True)
class RolloutBackendTraits:
    needs_gpu: bool  # runs only on an accelerator (vLLM); otherwise on the trainer's device
    # Stops generation in flight from another thread, handing back what it has: the disaggregated
    # producer pauses that way for each weight sync (and partial rollout continues what it got).
    supports_abort: bool
    # Hands back the weights it generates with, by their trainer names (tests compare them with the
    # trainer's); vLLM keeps its own fused layout.
    exports_served_weights: bool
    # Hands back, per response token, the experts an MoE policy routed it through (routing replay r3).
    returns_routed_experts: bool
    # Generates with FP8 weights re-quantized at every sync (rollout.quantization).
    quantizes_fp8: bool = False
    # Takes a fixed share of its GPU when awake (rollout.gpu_memory_utilization), so a colocated trainer
    # can tell whether it fits beside it (train_worker.offload_when_idle: auto).
    reserves_gpu_share: bool = False


ROLLOUT_BACKENDS: dict[str, RolloutBackendTraits] = {
    "transformers": RolloutBackendTraits(needs_gpu=False, supports_abort=True, exports_served_weights=True, returns_routed_experts=True),
    "vllm": RolloutBackendTraits(needs_gpu=True, supports_abort=True, exports_served_weights=False,
                                 returns_routed_experts=True,  # vLLM >= 0.26: enable_return_routed_experts
                                 quantizes_fp8=True,  # vLLM >= 0.26: layerwise reload of online-quantized weights
                                 reserves_gpu_share=True),
}


def backend_traits(name: str) -> RolloutBackendTraits:
    try:
        return ROLLOUT_BACKENDS[name]
    except KeyError:
        raise ValueError(f"Unknown rollout backend {name!r}; trellis has {', '.join(sorted(ROLLOUT_BACKENDS))}.") from None


def configurable_backends() -> set[str]:
    """The names ``rollout.backend`` accepts."""
    return set(get_args(RolloutConfig.model_fields["backend"].annotation))
