"""Routing metrics and the router's load-balancing loss: pure torch.

Shapes: T tokens, L MoE layers, K experts per token, E experts per layer.
"""

from __future__ import annotations

import math

import torch


def same_topk_TL(first_TLK: torch.Tensor, second_TLK: torch.Tensor) -> torch.Tensor:
    """Whether two routings picked the same set of experts, per token and layer (order within the
    top-k does not matter): bool [T, L]."""
    return (first_TLK.sort(dim=-1).values == second_TLK.to(first_TLK.dtype).sort(dim=-1).values).all(dim=-1)


def expert_counts_LE(ids_TLK: torch.Tensor, mask_T: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of the masked tokens' top-k slots each expert got, per layer: float [L, E]."""
    layers = ids_TLK.size(1)
    ids_NK = ids_TLK[mask_T].transpose(0, 1).reshape(layers, -1).long()
    return torch.zeros(layers, experts, device=ids_TLK.device).scatter_add_(1, ids_NK, torch.ones_like(ids_NK, dtype=torch.float32))


def load_entropy_and_max_share(counts_LE: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per layer: the entropy of the expert load divided by log E (1.0: perfectly balanced), and the
    largest share of the load one expert carries."""
    share_LE = counts_LE / counts_LE.sum(dim=-1, keepdim=True).clamp(min=1.0)
    entropy_L = -(share_LE * share_LE.clamp(min=1e-12).log()).sum(dim=-1) / math.log(counts_LE.size(-1))
    return entropy_L.tolist(), share_LE.max(dim=-1).values.tolist()


def load_balancing_loss(logits_per_layer: list[torch.Tensor], ids_TLK: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer auxiliary loss, averaged over layers: E x sum_e f_e P_e, f_e the share of
    the masked tokens' top-k slots expert e got (summing to K), P_e its mean router probability. 1.0 x K
    when balanced; it pulls the router towards spreading tokens evenly."""
    weight_T = mask_T.float()
    tokens = weight_T.sum().clamp(min=1.0)
    losses = []
    for layer, logits_TE in enumerate(logits_per_layer):
        experts = logits_TE.size(-1)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        slots_TE = torch.zeros_like(probs_TE).scatter_add_(1, ids_TLK[:, layer].long(), torch.ones_like(ids_TLK[:, layer], dtype=probs_TE.dtype))
        f_E = (slots_TE * weight_T[:, None]).sum(0) / tokens
        p_E = (probs_TE * weight_T[:, None]).sum(0) / tokens
        losses.append(experts * (f_E * p_E).sum())
    return torch.stack(losses).mean()
