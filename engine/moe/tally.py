"""A fit's routing figures, summed on the device over micro-batches and ranks, then reported as
``router/*`` metrics: agreement between the trainer's and the rollout engine's top-k, expert load per
layer, tokens replayed, sequences that fell back to computed routing."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trellis.engine.moe.routers import MoeShape
from trellis.engine.moe.routing import Replay, RoutingSession
from trellis.engine.moe.stats import expert_counts_LE, load_entropy_and_max_share, same_topk_TL


class RoutingTally:
    def __init__(self, shape: MoeShape, device: torch.device) -> None:
        self._shape = shape
        self._counts_LE = torch.zeros(shape.layers, shape.experts, device=device)
        self._agree_L = torch.zeros(shape.layers, device=device)
        # compared tokens, replayed tokens, fallback sequences, sequences
        self._totals = torch.zeros(4, device=device)

    def record_update(self, session: RoutingSession, tokens_T: torch.Tensor, replay: Replay | None) -> None:
        """One micro-batch's update forward: the experts it used, and the tokens it replayed."""
        self._counts_LE += expert_counts_LE(session.applied_TLK(), tokens_T, self._shape.experts)
        if replay is not None:
            self._totals[1] += (replay.mask_T & tokens_T).sum()

    def record_agreement(self, session: RoutingSession, tokens_T: torch.Tensor, recorded: Replay | None) -> None:
        """How the router's own top-k compares with the rollout engine's, where it recorded one. Taken on
        the step's first forward of each token (the weights the rollout ran with): under r3 the layers
        after the first see hidden states of replayed routing, as the update does."""
        if recorded is None:
            return
        compared_T = recorded.mask_T & tokens_T
        same_TL = same_topk_TL(session.computed_TLK(), recorded.experts_TLK)
        self._agree_L += same_TL[compared_T].float().sum(dim=0)
        self._totals[0] += compared_T.sum()

    def count_sequences(self, total: int, fallback: int) -> None:
        self._totals[2] += fallback
        self._totals[3] += total

    def metrics(self, *, reduce_over_ranks: bool) -> dict[str, float]:
        flat = torch.cat([self._counts_LE.flatten(), self._agree_L, self._totals])
        if reduce_over_ranks:
            flat = flat.to(_collective_device())
            dist.all_reduce(flat)
        layers, experts = self._shape.layers, self._shape.experts
        counts_LE = flat[: layers * experts].view(layers, experts).cpu()
        agree_L = flat[layers * experts : layers * experts + layers].cpu()
        compared, replayed, fallback, sequences = flat[-4:].tolist()
        entropy_L, max_share_L = load_entropy_and_max_share(counts_LE)
        metrics = {
            "router/load_entropy": sum(entropy_L) / layers,
            "router/load_max_share": max(max_share_L),
            "router/replayed_tokens": replayed,
            "router/fallback_sequences": fallback,
            "router/sequences": sequences,
        }
        for layer in range(layers):
            metrics[f"router/load_entropy/layer{layer}"] = entropy_L[layer]
            metrics[f"router/load_max_share/layer{layer}"] = max_share_L[layer]
        if compared:
            metrics["router/agreement"] = float(agree_L.sum()) / (compared * layers)
            for layer in range(layers):
                metrics[f"router/agreement/layer{layer}"] = float(agree_L[layer]) / compared
        return metrics


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
