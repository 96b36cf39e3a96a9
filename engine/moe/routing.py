"""Forward hooks on a model's routers: record the experts each token was sent to, and optionally send
tokens to given experts instead (routing replay).

A replay replaces only the router's choice of experts. The gate weights of the chosen experts are
still the router's own softmax probabilities, taken at the replayed ids, so the loss keeps reaching the
router's weights and it goes on learning. Tokens the replay mask leaves out (prompt tokens, sequences
without a recorded routing) keep the top-k the router computed.

The hooks run only inside ``RouterHooks.session``; outside one the model routes as if unhooked. A
session spans a forward and its backward, so that a layer recomputed in the backward pass (activation
checkpointing) routes as it did in the forward.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from trellis.engine.moe.routers import MoeShape, find_routers, moe_shape, normalizes


@dataclass(frozen=True)
class Replay:
    """Experts to send tokens to, in the token order the routers see (the flattened [N, L] rows of a
    padded batch, the one row of a packed one): ``experts_TLK`` [T, layers, K], used where ``mask_T``."""

    experts_TLK: torch.Tensor
    mask_T: torch.Tensor


@dataclass
class RoutingSession:
    """What the routers did in one forward, per MoE layer: the ids they computed, the ids the experts
    got (replayed or computed), and the router logits when ``keep_logits`` (the load-balancing loss)."""

    replay: Replay | None = None
    keep_logits: bool = False
    computed: dict[int, torch.Tensor] = field(default_factory=dict)
    applied: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)

    def computed_TLK(self) -> torch.Tensor:
        return torch.stack([self.computed[layer] for layer in sorted(self.computed)], dim=1)

    def applied_TLK(self) -> torch.Tensor:
        return torch.stack([self.applied[layer] for layer in sorted(self.applied)], dim=1)

    def logits_list(self) -> list[torch.Tensor]:
        return [self.logits[layer] for layer in sorted(self.logits)]


class RouterHooks:
    """Hooks on every router of ``model``, installed once; they act only while a session is open."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = find_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no router trellis knows (engine.moe.routers.ROUTERS).")
        self.shape: MoeShape = moe_shape(model)  # type: ignore[assignment]
        self._session: RoutingSession | None = None
        self._handles = [
            router.register_forward_hook(functools.partial(self._route, layer, normalizes(router)))
            for layer, router in enumerate(routers)
        ]

    @contextmanager
    def session(self, replay: Replay | None = None, *, keep_logits: bool = False) -> Iterator[RoutingSession]:
        if self._session is not None:
            raise RuntimeError("A routing session is already open on this model.")
        self._session = RoutingSession(replay=replay, keep_logits=keep_logits)
        try:
            yield self._session
        finally:
            self._session = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _route(self, layer: int, normalise: bool, module: torch.nn.Module, inputs, output):
        session = self._session
        if session is None:
            return None
        logits_TE, weights_TK, ids_TK = output
        session.computed[layer] = ids_TK.detach()
        if session.keep_logits:
            session.logits[layer] = logits_TE
        if session.replay is None:
            session.applied[layer] = ids_TK.detach()
            return None
        replay = session.replay
        if replay.mask_T.size(0) != ids_TK.size(0):
            raise RuntimeError(
                f"The routing replay holds {replay.mask_T.size(0)} tokens, the router of MoE layer {layer} sees "
                f"{ids_TK.size(0)}: the replay was built for another layout."
            )
        chosen_TK = torch.where(replay.mask_T[:, None], replay.experts_TLK[:, layer].to(ids_TK.dtype), ids_TK)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        chosen_weights_TK = probs_TE.gather(-1, chosen_TK)
        if normalise:
            chosen_weights_TK = chosen_weights_TK / chosen_weights_TK.sum(dim=-1, keepdim=True)
        session.applied[layer] = chosen_TK.detach()
        return logits_TE, chosen_weights_TK.to(weights_TK.dtype), chosen_TK
