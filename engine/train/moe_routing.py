"""The trainer's side of an MoE policy's routing: which routing each forward pass uses (routing replay
r3 or r2, or the router's own), the routing metrics of a fit, the load-balancing loss and the MoE shape
a checkpoint records. For a dense policy every part of it does nothing."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from trellis.engine.config import TrellisConfig
from trellis.engine.data.prepare import TrainSequence
from trellis.engine.moe.checks import check_routing_settings, moe_mismatch, recorded_routing
from trellis.engine.moe.routers import moe_shape
from trellis.engine.moe.routing import Replay, RouterHooks, RoutingSession
from trellis.engine.moe.stats import load_balancing_loss
from trellis.engine.moe.tally import RoutingTally


class TrainerRouting:
    def __init__(self, model: torch.nn.Module, config: TrellisConfig, device: torch.device) -> None:
        self.shape = moe_shape(model)
        check_routing_settings(config, self.shape, type(model).__name__)
        self._hooks = RouterHooks(model) if self.shape is not None else None
        self._mode = config.train_worker.routing_replay
        self._aux = config.loss.router_aux_coef
        self._device = device
        self._tally: RoutingTally | None = None

    @property
    def is_moe(self) -> bool:
        return self.shape is not None

    @contextmanager
    def session(self, batch: Any, own_route: torch.Tensor | None = None) -> Iterator[RoutingSession | None]:
        """One forward (and its backward) of ``batch``: r3 routes its response tokens as the rollout engine
        did, r2 every token as ``own_route`` (the old-policy pass's routing) says, else the router decides."""
        if self._hooks is None:
            yield None
            return
        with self._hooks.session(self._replay(own_route, batch), keep_logits=self._aux > 0) as session:
            yield session

    def _replay(self, own_route: torch.Tensor | None, batch: Any) -> Replay | None:
        if self._mode == "r3":
            return recorded_routing(batch)
        if self._mode == "r2" and own_route is not None:
            return Replay(own_route, torch.ones(own_route.size(0), dtype=torch.bool, device=own_route.device))
        return None

    def own_route(self, session: RoutingSession | None) -> torch.Tensor | None:
        """What r2 keeps of the old-policy pass: the experts the trainer routed each token to."""
        return session.computed_TLK() if session is not None and self._mode == "r2" else None

    def aux_loss(self, session: RoutingSession | None, batch: Any, total_tokens: float) -> torch.Tensor | None:
        """The load-balancing loss of this micro-batch, weighted by its share of the trained tokens (as
        token-mean weighs the policy loss); None when off."""
        if session is None or self._aux <= 0:
            return None
        share = batch.loss_mask_NL.sum() / max(total_tokens, 1.0)
        return self._aux * load_balancing_loss(session.logits_list(), session.applied_TLK(), batch.tokens_T) * share

    # -- a fit's metrics ----------------------------------------------------------------------------

    def start_fit(self) -> None:
        self._tally = RoutingTally(self.shape, self._device) if self.shape is not None else None

    def observe(self, session: RoutingSession | None, batch: Any, *, agreement: bool, update: bool) -> None:
        """Count a forward of this rank's share: the agreement with the engine's routing on a token's first
        forward of the step, the expert load and replayed tokens of the update."""
        if session is None or self._tally is None:
            return
        if update:
            self._tally.record_update(session, batch.tokens_T, session.replay)
        if agreement:
            self._tally.record_agreement(session, batch.tokens_T, recorded_routing(batch))

    def finish_fit(self, mine: list[TrainSequence], *, reduce_over_ranks: bool) -> dict[str, float]:
        if self._tally is None:
            return {}
        self._tally.count_sequences(len(mine), sum(seq.routed_experts is None for seq in mine))
        return self._tally.metrics(reduce_over_ranks=reduce_over_ranks)

    # -- checkpoints --------------------------------------------------------------------------------

    def checkpoint_entry(self) -> dict[str, int] | None:
        return None if self.shape is None else dataclasses.asdict(self.shape)

    def load_problem(self, uri: str, trainer_state: dict[str, Any]) -> str | None:
        # Checkpoints written before MoE support carry no "moe" entry: they are dense.
        return moe_mismatch(uri, trainer_state.get("moe"), self.shape)
