"""Settings that only an MoE policy can honour, checked against the policy itself: before the run
(``engine.run.preflight``, from the checkpoint's config.json) and again where the trainer loads it."""

from __future__ import annotations

from typing import Any

from trellis.engine.config import TrellisConfig
from trellis.engine.errors import SettingError
from trellis.engine.moe.routers import MoeShape
from trellis.engine.moe.routing import Replay


def moe_setting_problems(config: TrellisConfig, is_moe: bool, model: str) -> list[str]:
    """``model`` names the policy in the messages (its class or checkpoint)."""
    if is_moe:
        return []
    problems = []
    mode = config.train_worker.routing_replay
    if mode != "none":
        problems.append(
            f"train_worker.routing_replay: {mode} replays the routing of a mixture-of-experts policy, and load_from="
            f"{config.load_from} ({model}) is dense: set routing_replay: none."
        )
    if config.loss.router_aux_coef > 0:
        problems.append(
            f"loss.router_aux_coef balances the experts of a mixture-of-experts policy, and load_from={config.load_from} "
            f"({model}) is dense: set router_aux_coef: 0."
        )
    if config.rollout.return_routed_experts:
        problems.append(
            f"rollout.return_routed_experts records the experts of a mixture-of-experts policy, and load_from="
            f"{config.load_from} ({model}) is dense: set return_routed_experts: false."
        )
    return problems


def check_routing_settings(config: TrellisConfig, shape: MoeShape | None, model: str) -> None:
    problems = moe_setting_problems(config, shape is not None, model)
    if problems:
        raise SettingError("\n".join(problems))


def recorded_routing(batch: Any) -> Replay | None:
    """The rollout engine's routing a micro-batch layout carries (packed or padded), if any."""
    if batch.routed_experts_TLK is None:
        return None
    return Replay(batch.routed_experts_TLK, batch.routed_mask_T)


def moe_mismatch(uri: str, saved: dict[str, int] | None, shape: MoeShape | None) -> str | None:
    """Why a checkpoint cannot load into this policy, or None: it loads only into a policy with its
    experts; another expert count (or top-k, or MoE layer count) would fail deep in the weight loading,
    or worse, load and route differently."""
    mine = None if shape is None else {"layers": shape.layers, "experts": shape.experts, "top_k": shape.top_k}
    if saved == mine:
        return None
    return (
        f"{uri} was saved from a policy with {_describe(saved)}, and this run's policy has {_describe(mine)}: "
        "resume it with the model it was trained from (load_from), or start this model from its own checkpoint."
    )


def _describe(shape: dict[str, int] | None) -> str:
    if shape is None:
        return "no experts (dense)"
    return f"{shape['layers']} MoE layers of {shape['experts']} experts, top-{shape['top_k']}"
