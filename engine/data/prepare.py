"""Turn rollout groups into training sequences, following XTuner's ``_prepare_train_data`` rules.

For a prompt ``p`` (P tokens) and a response ``r`` (R tokens) the model input is ``p + r[:-1]``
(P + R - 1 positions) and position ``i`` predicts ``labels[i]``: ``-100`` on the first P - 1
positions, then the response tokens (``-100`` where ``response_mask`` is 0, e.g. tool output).
Rollout logprobs and advantages are aligned with the labels and are 0 wherever the label is -100.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from trellis.engine.algo.advantages import compute_group_advantages, estimator
from trellis.engine.config import AdvantageConfig
from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.vision.images import PromptImage

logger = logging.getLogger(__name__)
IGNORE = -100


@dataclass
class TrainSequence:
    input_ids: list[int]
    labels: list[int]
    advantages: list[float]
    rollout_logprobs: list[float]
    rollout_id: str = ""
    prompt_length: int = 0  # leading input tokens shared by every sample of the prompt (0: unknown)
    # MoE: the rollout engine's experts for the positions from prompt_length - 1 on, one per response
    # token ([R, layers, K]); None where the rollout recorded none, or not all of it.
    routed_experts: torch.Tensor | None = None
    images: tuple[PromptImage, ...] = ()  # a vision-language prompt's, in placeholder order

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class PreparedBatch:
    sequences: list[TrainSequence]
    info: dict[str, float] = field(default_factory=dict)


def invalid_reason(group: list[RolloutSample]) -> str | None:
    """Why a group cannot be trained on, or None. One bad sample spoils its group: GRPO-style
    advantages compare the samples of a group, so a partial group would bias them."""
    for status in (Status.FILTERED, Status.FAILED, Status.ABORTED):
        if any(sample.status == status for sample in group):
            return f"a sample is {status.value}"
    for sample in group:
        if not sample.prompt_ids:
            return "a sample has no prompt ids"
        if not sample.response_ids:
            return "a sample has an empty response"
        if len(sample.logprobs) != len(sample.response_ids):
            return "a sample's logprobs and response ids differ in length"
        if sample.response_mask is not None and len(sample.response_mask) != len(sample.response_ids):
            return "a sample's response mask and response ids differ in length"
        if sample.reward is None:
            return "a sample has no reward"
    return None


def group_outcome(group: list[RolloutSample]) -> tuple[str, str]:
    """What training makes of a group, as the ledger records it: ``("trained", "")``, or why it is left
    out: ``filtered`` (dynamic sampling), ``failed`` (a sample's reward or generation failed) or
    ``invalid`` (aborted, empty, or inconsistent), with the reason."""
    reason = invalid_reason(group)
    if reason is None:
        return "trained", ""
    if all(sample.status == Status.FILTERED for sample in group):
        return "filtered", group[0].error or reason
    failed = [sample for sample in group if sample.status == Status.FAILED]
    if failed:
        return "failed", failed[0].error or reason
    return "invalid", reason


def build_sequence(sample: RolloutSample, advantage: float) -> TrainSequence:
    prompt, response = sample.prompt_ids, sample.response_ids
    mask = sample.response_mask or [1] * len(response)
    response_labels = [token if keep else IGNORE for token, keep in zip(response, mask)]
    labels = [IGNORE] * (len(prompt) - 1) + response_labels
    return TrainSequence(
        input_ids=list(prompt) + list(response[:-1]),
        labels=labels,
        advantages=[0.0 if label == IGNORE else advantage for label in labels],
        rollout_logprobs=[0.0] * (len(prompt) - 1)
        + [lp if keep else 0.0 for lp, keep in zip(sample.logprobs, mask)],
        rollout_id=sample.rollout_id,
        prompt_length=len(prompt),
        routed_experts=_whole_routing(sample),
        images=tuple(sample.images),
    )


def _whole_routing(sample: RolloutSample) -> torch.Tensor | None:
    routing = sample.routed_experts
    return routing if routing is not None and routing.size(0) == len(sample.response_ids) else None


def session_advantages(group: list[RolloutSample], config: AdvantageConfig) -> list[float]:
    """Advantages per sample, computed once per session and broadcast to the session's segments
    (a session's length, for OPO, is the tokens its segments generated)."""
    session_index: dict[str, int] = {}
    session_rewards: list[float] = []
    session_lengths: list[int] = []
    sample_session: list[int] = []
    for sample in group:
        if sample.session_id not in session_index:
            session_index[sample.session_id] = len(session_rewards)
            session_rewards.append(float(sample.reward))  # type: ignore[arg-type]
            session_lengths.append(0)
        sample_session.append(session_index[sample.session_id])
        session_lengths[sample_session[-1]] += sample.generated_tokens
    advantages = compute_group_advantages(
        [torch.tensor(session_rewards)], config, [torch.tensor(session_lengths)]
    )[0].tolist()
    return [advantages[i] for i in sample_session]


def prepare_train_data(
    groups: list[list[RolloutSample]],
    config: AdvantageConfig,
    *,
    shuffle: bool,
    seed: int,
    mask_truncated: bool = False,
) -> PreparedBatch:
    """``mask_truncated``: a response cut at its budget counts in its group's baseline but is not
    trained on. Groups dynamic sampling filtered are left out quietly (they are counted, not warned of)."""
    valid: list[list[RolloutSample]] = []
    skipped: dict[str, int] = {}
    filtered = 0
    for group in groups:
        reason = invalid_reason(group)
        if reason is None:
            valid.append(group)
        elif all(sample.status == Status.FILTERED for sample in group):
            filtered += 1
        else:
            skipped[reason] = skipped.get(reason, 0) + 1
    for reason, count in skipped.items():
        logger.warning("Skipped %d group(s) for training: %s", count, reason)

    sequences: list[TrainSequence] = []
    session_rewards: list[float] = []
    truncated = 0
    if estimator(config.estimator).whole_batch:
        per_group = _batch_advantages(valid, config)
    else:
        per_group = [session_advantages(group, config) for group in valid]
    for group, advantages in zip(valid, per_group):
        seen_sessions: set[str] = set()
        for sample, advantage in zip(group, advantages):
            if mask_truncated and sample.finish_reason == "length":
                truncated += 1
            else:
                sequences.append(build_sequence(sample, advantage))
            if sample.session_id not in seen_sessions:
                seen_sessions.add(sample.session_id)
                session_rewards.append(float(sample.reward))  # type: ignore[arg-type]
    if shuffle:
        random.Random(seed).shuffle(sequences)
    info = _response_info(valid, sequences, session_rewards, groups)
    info.update(_token_fates(groups, mask_truncated))
    info["skipped_groups"] = float(sum(skipped.values()))
    info["filtered_groups"] = float(filtered)
    info["truncated_masked_samples"] = float(truncated)
    return PreparedBatch(sequences, info)


def _token_fates(groups: list[list[RolloutSample]], mask_truncated: bool) -> dict[str, float]:
    """The batch's generated response tokens by what became of them: trained, or discarded and why
    (``group_outcome``; ``truncated``: cut at the budget and masked out). Goodput prices them."""
    fates = {"trained_response_tokens": 0.0, **{f"discarded_tokens/{why}": 0.0 for why in ("filtered", "failed", "invalid", "truncated")}}
    for group in groups:
        outcome = group_outcome(group)[0]
        for sample in group:
            tokens = float(len(sample.response_ids))
            if outcome != "trained":
                fates[f"discarded_tokens/{outcome}"] += tokens
            elif mask_truncated and sample.finish_reason == "length":
                fates["discarded_tokens/truncated"] += tokens
            else:
                fates["trained_response_tokens"] += tokens
    return fates


def _batch_advantages(groups: list[list[RolloutSample]], config: AdvantageConfig) -> list[list[float]]:
    """A whole-batch estimator (REINFORCE++ whitens across the batch) takes all groups together."""
    if not groups:
        return []
    rewards = [torch.tensor([float(s.reward) for s in group]) for group in groups]  # type: ignore[arg-type]
    return [adv.tolist() for adv in compute_group_advantages(rewards, config)]


def _response_info(
    valid: list[list[RolloutSample]],
    sequences: list[TrainSequence],
    session_rewards: list[float],
    all_groups: list[list[RolloutSample]],
) -> dict[str, float]:
    """The reference's ``response/*`` statistics (keys without the prefix)."""
    samples = [sample for group in valid for sample in group]
    raw = [s.reward for group in all_groups for s in group if s.reward is not None]
    rewards = torch.tensor(session_rewards or [0.0])
    response_tokens = [a for seq in sequences for a, label in zip(seq.advantages, seq.labels) if label != IGNORE]
    advantages = torch.tensor(response_tokens or [0.0])
    response_len = torch.tensor([float(len(s.response_ids)) for s in samples] or [0.0])
    prompt_len = torch.tensor([float(len(s.prompt_ids)) for s in samples] or [0.0])
    return {
        **_per_task(valid),
        "batch_size": float(len(samples)),
        "training_samples": float(len(sequences)),
        "training_tokens": float(sum(seq.num_tokens for seq in sequences)),
        "rewards/mean": rewards.mean().item(),
        "rewards/min": rewards.min().item(),
        "rewards/max": rewards.max().item(),
        "raw_rewards/mean": sum(raw) / len(raw) if raw else 0.0,
        "advantages/mean": advantages.mean().item(),
        "advantages/min": advantages.min().item(),
        "advantages/max": advantages.max().item(),
        "response_len/mean": response_len.mean().item(),
        "response_len/min": response_len.min().item(),
        "response_len/max": response_len.max().item(),
        "response_len/std": response_len.std().item() if response_len.numel() > 1 else 0.0,
        "prompt_len/mean": prompt_len.mean().item(),
        "prompt_len/min": prompt_len.min().item(),
        "prompt_len/max": prompt_len.max().item(),
    }


def _per_task(groups: list[list[RolloutSample]]) -> dict[str, float]:
    """``{task}/rewards/mean``, ``{task}/response_len/mean`` and ``{task}/groups`` when the batch mixes tasks."""
    by_task: dict[str, list[RolloutSample]] = {}
    for group in groups:
        by_task.setdefault(group[0].task_name, []).extend(group)
    if len(by_task) < 2:
        return {}
    info = {}
    for task, samples in sorted(by_task.items()):
        info[f"{task}/rewards/mean"] = sum(float(s.reward or 0.0) for s in samples) / len(samples)
        info[f"{task}/response_len/mean"] = sum(len(s.response_ids) for s in samples) / len(samples)
        info[f"{task}/groups"] = float(sum(group[0].task_name == task for group in groups))
    return info
