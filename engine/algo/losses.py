"""Policy-gradient losses, KL penalties and rollout importance-sampling correction.

Shapes: N sequences of a micro-batch, L positions (right-padded); ``mask_NL`` is 1 on positions
whose label is trained on. Every function here is pure and works on CPU.
"""

from __future__ import annotations

import math

import torch

from trellis.engine.config import LossConfig, RolloutISConfig


def token_logprobs(logits_NLV: torch.Tensor, labels_NL: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(label) per position, in float32; -100 labels give 0."""
    logits = logits_NLV.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    safe_labels = labels_NL.clamp(min=0)
    picked = logits.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    logprobs = picked - torch.logsumexp(logits, dim=-1)
    return torch.where(labels_NL >= 0, logprobs, torch.zeros_like(logprobs))


def ppo_clip_loss(
    logprobs_NL: torch.Tensor,
    old_logprobs_NL: torch.Tensor,
    advantages_NL: torch.Tensor,
    mask_NL: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip loss with asymmetric clip (clip-higher) and optional dual clip.

    Returns the unreduced loss and token counts of each clipping event (sums over the mask).
    """
    ratio = torch.exp(logprobs_NL - old_logprobs_NL)
    unclipped = -advantages_NL * ratio
    clipped = -advantages_NL * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    mask = mask_NL.float()
    counts = {
        "clipped_low": ((ratio < 1.0 - clip_eps_low) & (advantages_NL < 0)).float().mul(mask).sum(),
        "clipped_high": ((ratio > 1.0 + clip_eps_high) & (advantages_NL > 0)).float().mul(mask).sum(),
    }
    if dual_clip_c is not None:
        bound = -advantages_NL * dual_clip_c
        dual = (advantages_NL < 0) & (loss > bound)
        loss = torch.where(advantages_NL < 0, torch.minimum(loss, bound), loss)
        counts["dual_clipped"] = dual.float().mul(mask).sum()
    return loss, counts


def kl_penalty(logprobs_NL: torch.Tensor, ref_logprobs_NL: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) (Schulman's k1 / k2 / k3)."""
    log_ratio = logprobs_NL - ref_logprobs_NL
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"Unknown kl_type {kind!r}; use k1, k2 or k3.")


def aggregate(
    loss_NL: torch.Tensor, mask_NL: torch.Tensor, mode: str, *, total_tokens: float, total_sequences: float,
    norm_length: float = 1.0,
) -> torch.Tensor:
    """Reduce to a scalar whose gradients add up correctly over the micro-batches of a mini-batch.

    ``total_tokens`` / ``total_sequences`` count the whole mini-batch, not this micro-batch.
    ``seq-mean-token-sum-norm`` (Dr.GRPO) divides each sequence's sum by the constant ``norm_length``
    (the generation budget), so no sequence's tokens weigh more for being fewer.
    """
    mask = mask_NL.float()
    if mode == "token-mean":
        return (loss_NL * mask).sum() / max(total_tokens, 1.0)
    per_sequence_sum = (loss_NL * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return per_sequence_sum.sum() / max(total_sequences, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return per_sequence_sum.sum() / (max(total_sequences, 1.0) * norm_length)
    if mode == "seq-mean-token-mean":
        per_sequence_mean = per_sequence_sum / mask.sum(-1).clamp(min=1.0)
        return per_sequence_mean.sum() / max(total_sequences, 1.0)
    raise ValueError(f"Unknown loss aggregation {mode!r}.")


def rollout_is_weights(
    old_logprobs_NL: torch.Tensor, rollout_logprobs_NL: torch.Tensor, mask_NL: torch.Tensor, config: RolloutISConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights pi_train / pi_rollout that correct for the rollout engine's mismatch.

    The ratio is per token, per sequence (the product of its tokens' ratios) or geometric (their
    geometric mean, per sequence). truncate: w = min(w, upper). mask: w kept inside [mask_lower,
    mask_upper], 0 outside (the token, or the whole sequence at sequence levels). both: masked, then
    the kept ratios capped at upper. veto: a sequence with any token ratio below ``veto_threshold`` gets
    0 everywhere. Returns weights (no grad) and metric sums (``rejected``: tokens capped or dropped).
    """
    mask = mask_NL.float()
    token_log_ratio = (old_logprobs_NL - rollout_logprobs_NL).detach() * mask
    log_ratio = token_log_ratio
    if config.level == "sequence":
        log_ratio = token_log_ratio.sum(-1, keepdim=True).expand_as(token_log_ratio)
    elif config.level == "geometric":
        mean = token_log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        log_ratio = mean.expand_as(token_log_ratio)
    weights = torch.exp(log_ratio.clamp(-20.0, 20.0))
    lower = config.lower if config.lower is not None else 1.0 / config.upper
    mask_upper = config.mask_upper if config.mask_upper is not None else config.upper
    mask_lower = config.mask_lower if config.mask_lower is not None else lower
    dropped = torch.zeros_like(weights, dtype=torch.bool)
    if config.mode in ("mask", "both"):
        dropped = (weights > mask_upper) | (weights < mask_lower)
    if config.veto_threshold is not None:
        vetoed = ((token_log_ratio < math.log(config.veto_threshold)) & mask_NL.bool()).any(-1, keepdim=True)
        dropped = dropped | vetoed.expand_as(dropped)
    capped = (weights > config.upper) & ~dropped if config.mode in ("truncate", "both") else torch.zeros_like(dropped)
    weights = torch.where(dropped, torch.zeros_like(weights), weights.clamp(max=config.upper) if config.mode != "mask" else weights)
    weights = weights * mask
    stats = {
        "weight_sum": weights.sum(),
        "weight_max": (weights + (mask - 1.0) * 1e9).max(),
        "weight_min": (weights + (1.0 - mask) * 1e9).min(),
        "rejected": ((dropped | capped).float() * mask).sum(),
    }
    return weights, stats


def mismatch_sums(
    old_logprobs_NL: torch.Tensor, rollout_logprobs_NL: torch.Tensor, mask_NL: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums over tokens of train-vs-rollout logprob mismatch measures (divide by token count).

    The tokens were sampled by the rollout policy, so k3 estimates KL(pi_rollout || pi_train) with
    r = pi_train / pi_rollout: r - 1 - log r, unbiased because E_rollout[r] = 1."""
    mask = mask_NL.float()
    diff = (old_logprobs_NL - rollout_logprobs_NL) * mask
    return {
        "k3_kl": ((torch.exp(diff) - 1.0 - diff) * mask).sum(),
        "abs_logprob_diff": diff.abs().sum(),
        "abs_logprob_diff_max": diff.abs().max(),
        "train_nll": (-old_logprobs_NL * mask).sum(),
        "rollout_nll": (-rollout_logprobs_NL * mask).sum(),
    }


def policy_objective(
    logprobs_NL: torch.Tensor,
    old_logprobs_NL: torch.Tensor,
    advantages_NL: torch.Tensor,
    mask_NL: torch.Tensor,
    config: LossConfig,
    *,
    is_weights_NL: torch.Tensor | None = None,
    ref_logprobs_NL: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token policy loss (IS-weighted when given) and KL term, both unreduced."""
    pg_loss, counts = ppo_clip_loss(
        logprobs_NL,
        old_logprobs_NL,
        advantages_NL,
        mask_NL,
        clip_eps_low=config.clip_eps_low,
        clip_eps_high=config.clip_eps_high,
        dual_clip_c=config.dual_clip_c,
    )
    if is_weights_NL is not None:
        pg_loss = pg_loss * is_weights_NL
    kl = None
    if ref_logprobs_NL is not None and config.kl_coef > 0:
        kl = kl_penalty(logprobs_NL, ref_logprobs_NL, config.kl_type)
    return pg_loss, kl, counts
