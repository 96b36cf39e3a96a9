"""Which modules of a transformers model are its MoE routers, and the model's MoE shape.

Every router trellis supports is a softmax-then-top-k gate whose ``forward`` takes the flattened hidden
states [T, H] and returns ``(logits [T, E], weights [T, K], expert ids [T, K])``. A new architecture is
one row of ``ROUTERS`` once its gate follows that contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

# Router class -> whether its top-k weights are renormalised to sum to 1.
ROUTERS: dict[type[torch.nn.Module], Callable[[Any], bool]] = {
    Qwen3MoeTopKRouter: lambda router: bool(router.norm_topk_prob),
    Qwen2MoeTopKRouter: lambda router: bool(router.norm_topk_prob),
    OlmoeTopKRouter: lambda router: bool(router.norm_topk_prob),
    MixtralTopKRouter: lambda router: True,
}
# Keys HF configs use for the expert count, by family (Qwen, Mixtral, DeepSeek).
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoeShape:
    """L routed layers, E experts per layer, K experts per token."""

    layers: int
    experts: int
    top_k: int

    @property
    def id_dtype(self) -> torch.dtype:
        """The narrowest integer that holds an expert id: one byte up to 256 experts."""
        return torch.uint8 if self.experts <= 256 else torch.int16

    def describe(self) -> str:
        return f"{self.layers} MoE layers x {self.experts} experts, top-{self.top_k}"


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers in layer order (empty for a dense model)."""
    return [module for module in model.modules() if type(module) in ROUTERS]


def normalizes(router: torch.nn.Module) -> bool:
    return ROUTERS[type(router)](router)


def moe_shape(model: torch.nn.Module) -> MoeShape | None:
    routers = find_routers(model)
    if not routers:
        return None
    return MoeShape(layers=len(routers), experts=int(routers[0].num_experts), top_k=int(routers[0].top_k))


def config_moe_shape(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """(experts, top-k) from an HF ``config.json``'s fields, or None for a dense model; for checks made
    before any model is loaded."""
    experts = next((config[key] for key in _EXPERT_KEYS if config.get(key)), None)
    if not experts or not config.get("num_experts_per_tok"):
        return None
    return int(experts), int(config["num_experts_per_tok"])
