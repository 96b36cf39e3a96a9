"""Lay out the recorded routings of a micro-batch's sequences in the token order its routers see.

A sequence's routing covers its response: the entry for response token j is the routing of the input
position that predicted it (the last prompt token for j = 0, response token j - 1 after that), the
same alignment as its rollout logprobs. Those positions start at ``prompt_length - 1``.
"""

from __future__ import annotations

import torch

from trellis.engine.data.prepare import TrainSequence


def replay_rows(sequences: list[TrainSequence], starts: list[int], total: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(experts_TLK, mask_T)`` over ``total`` token slots, sequence i's position 0 at ``starts[i]``;
    (None, None) when no sequence has a routing."""
    recorded = [(seq, start) for seq, start in zip(sequences, starts) if seq.routed_experts is not None]
    if not recorded:
        return None, None
    first = recorded[0][0].routed_experts
    experts_TLK = torch.zeros((total, *first.shape[1:]), dtype=first.dtype)
    mask_T = torch.zeros(total, dtype=torch.bool)
    for seq, start in recorded:
        routing = seq.routed_experts
        begin = start + seq.prompt_length - 1
        experts_TLK[begin : begin + routing.size(0)] = routing
        mask_T[begin : begin + routing.size(0)] = True
    return experts_TLK, mask_T
