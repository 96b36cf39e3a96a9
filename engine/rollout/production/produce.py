"""Produce a batch: sample prompts, generate ``prompt_repeat_k`` responses each, score them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from trellis.engine.rollout.rewards.shaping import OverlongShaping
from trellis.engine.config import RolloutConfig
from trellis.engine.data.prompts import PromptRecord
from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.rollout.agents.agent_metrics import agent_summary
from trellis.engine.rollout.agents.base import AgentLoop
from trellis.engine.rollout.agents.generate import generate
from trellis.engine.rollout.backends.base import RolloutBackend, SamplingParams
from trellis.engine.rollout.rewards.runner import RewardRunner
from trellis.engine.storage.lake import summary as trajectory_summary
from trellis.engine.storage.ledger import LedgerEntries


@dataclass
class ProduceResult:
    groups: list[list[RolloutSample]]
    produce_time_s: float = 0.0
    produced_samples: int = 0
    produced_tokens: int = 0
    failed_samples: int = 0
    launched_s: float = 0.0  # wall time (time.time()) the rollout started
    counters: dict[str, float] = field(default_factory=dict)  # e.g. dynamic sampling's sampling/*
    ledger: LedgerEntries | None = None  # what the ledger records with this batch (training batches only)

    @classmethod
    def of(cls, groups: list[list[RolloutSample]], produce_time_s: float = 0.0, launched_s: float | None = None) -> ProduceResult:
        """A result with its counts taken from the groups."""
        samples = [s for group in groups for s in group]
        return cls(
            groups=groups,
            produce_time_s=produce_time_s,
            launched_s=time.time() - produce_time_s if launched_s is None else launched_s,
            produced_samples=len(samples),
            produced_tokens=sum(len(s.response_ids) for s in samples),
            failed_samples=sum(s.status == Status.FAILED for s in samples),
        )


def sampling_params(config: RolloutConfig, *, seed: int, evaluation: bool = False) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=config.max_new_tokens,
        temperature=config.eval_temperature if evaluation else config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop_token_ids=config.stop_token_ids,
        seed=seed,
    )


def step_seed(base_seed: int, step: int, salt: int = 0) -> int:
    """A per-step sampling seed: a resumed run draws the same tokens at the same step."""
    return (base_seed * 1_000_003 + step * 7919 + salt) % (2**63 - 1)


def new_groups(
    prompts: list[tuple[int, PromptRecord]], *, repeat: int, version: int, train_step: int, id_prefix: str
) -> list[list[RolloutSample]]:
    """``repeat`` empty samples for each (epoch, prompt); one group per prompt, ids unique per
    ``id_prefix`` and ``train_step`` (the step the batch is made for)."""
    groups = []
    for g, (epoch, prompt) in enumerate(prompts):
        group_id = f"{id_prefix}{train_step:06d}-g{g:04d}"
        groups.append([
            RolloutSample(
                rollout_id=f"{group_id}-{k:03d}",
                group_id=group_id,
                session_id=f"{group_id}-{k:03d}",
                prompt_index=prompt.index,
                messages=list(prompt.messages),
                prompt_ids=list(prompt.prompt_ids),
                label=prompt.label,
                data_source=prompt.data_source,
                task_name=prompt.task_name,
                extra=dict(prompt.extra),
                policy_version=version,
                train_step=train_step,
                epoch=epoch,
                max_new_tokens=prompt.max_new_tokens,
                images=list(prompt.images),
            )
            for k in range(repeat)
        ])
    return groups


def score(samples: list[RolloutSample], rewards: RewardRunner, overlong: OverlongShaping | None = None) -> None:
    """Score the completed samples (a session whose agent reported its reward keeps it); a reward
    function that fails marks its sample FAILED. With
    ``overlong`` (training only), a long response's penalty is added and kept in its payload."""
    completed = [s for s in samples if s.status == Status.COMPLETED]
    scorable = [s for s in completed if _reported_reward(s) is None]
    for sample in completed:
        if _reported_reward(sample) is not None:
            sample.reward, sample.reward_payload = _reported_reward(sample), {"from": "agent"}
    started = time.time()
    for sample, result in zip(scorable, rewards.score([s.reward_input() for s in scorable])):
        if result.error is not None:
            sample.fail(result.error)
        else:
            sample.reward, sample.reward_payload = result.score, result.payload
        sample.timings.append(("reward", result.started_s or started, result.ended_s or time.time(),
                               {"reward": sample.reward if result.error is None else "failed"}))
    for sample in completed:
        penalty = overlong.penalty(sample) if overlong is not None and sample.status == Status.COMPLETED else 0.0
        if penalty:
            sample.reward += penalty
            sample.reward_payload = {**sample.reward_payload, "overlong_penalty": penalty}


def _reported_reward(sample: RolloutSample) -> float | None:
    """The reward an agent of the openai loop returned for its session, if it did."""
    return sample.agent.get("reward") if sample.agent is not None else None


def rollout_groups(
    prompts: list[tuple[int, PromptRecord]],
    *,
    repeat: int,
    backend: RolloutBackend,
    rewards: RewardRunner,
    params: SamplingParams,
    train_step: int,
    id_prefix: str,
    overlong: OverlongShaping | None = None,
    agent_loop: AgentLoop | None = None,
) -> ProduceResult:
    """Generate (one response each, or through ``agent_loop``) and score ``repeat`` samples for each
    (epoch, prompt); one group per prompt."""
    launched_s, started = time.time(), time.perf_counter()
    groups = new_groups(prompts, repeat=repeat, version=backend.policy_version, train_step=train_step, id_prefix=id_prefix)
    samples = [sample for group in groups for sample in group]
    if agent_loop is None:
        generate(samples, backend, params)
    else:
        agent_loop.run(samples, backend, params)
    score(samples, rewards, overlong)
    return ProduceResult.of(groups, produce_time_s=time.perf_counter() - started, launched_s=launched_s)


def produce_summary(result: ProduceResult) -> dict[str, float]:
    """The few numbers of a produced batch that travel to the orchestrator and the metrics."""
    samples = [s for group in result.groups for s in group]
    return {
        "produce_time_s": result.produce_time_s,
        "produced_samples": float(result.produced_samples),
        "produced_tokens": float(result.produced_tokens),
        "failed_samples": float(result.failed_samples),
        "policy_version": float(samples[0].policy_version if samples else 0),
        **{f"trajectory/{k}": v for k, v in trajectory_summary(samples).items()},
        **agent_summary(samples),
        **result.counters,
    }
