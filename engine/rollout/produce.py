"""Produce a batch: sample prompts, generate ``prompt_repeat_k`` responses each, score them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.config import RolloutConfig
from engine.data.prompts import PromptRecord
from engine.data.samples import RolloutSample, Status
from engine.rollout.base import RolloutBackend, SamplingParams
from engine.rollout.rewards import RewardRunner
from engine.storage.lake import summary as trajectory_summary


@dataclass
class ProduceResult:
    groups: list[list[RolloutSample]]
    produce_time_s: float = 0.0
    produced_samples: int = 0
    produced_tokens: int = 0
    failed_samples: int = 0
    launched_s: float = 0.0  # wall time (time.time()) the rollout started

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


def rollout_groups(
    prompts: list[PromptRecord],
    *,
    repeat: int,
    backend: RolloutBackend,
    rewards: RewardRunner,
    params: SamplingParams,
    train_step: int,
    id_prefix: str,
) -> ProduceResult:
    """Generate and score ``repeat`` samples for each prompt; one group per prompt."""
    launched_s, started = time.time(), time.perf_counter()
    samples: list[RolloutSample] = []
    for g, prompt in enumerate(prompts):
        for k in range(repeat):
            rollout_id = f"{id_prefix}{train_step:06d}-g{g:04d}-{k:03d}"
            samples.append(
                RolloutSample(
                    rollout_id=rollout_id,
                    group_id=f"{id_prefix}{train_step:06d}-g{g:04d}",
                    session_id=rollout_id,
                    prompt_index=prompt.index,
                    messages=list(prompt.messages),
                    prompt_ids=list(prompt.prompt_ids),
                    label=prompt.label,
                    data_source=prompt.data_source,
                    task_name=prompt.task_name,
                    extra=dict(prompt.extra),
                    policy_version=backend.policy_version,
                    train_step=train_step,
                )
            )
    generations = backend.generate([s.prompt_ids for s in samples], params)
    for sample, generation in zip(samples, generations):
        sample.response_ids = generation.response_ids
        sample.logprobs = generation.logprobs
        sample.response = generation.text
        sample.finish_reason = generation.finish_reason
        if generation.finish_reason == "abort":
            sample.status = Status.ABORTED
    scorable = [s for s in samples if s.status == Status.COMPLETED]
    for sample, result in zip(scorable, rewards.score([s.reward_input() for s in scorable])):
        if result.error is not None:
            sample.fail(result.error)
        else:
            sample.reward = result.score
            sample.reward_payload = result.payload
    groups = [samples[i : i + repeat] for i in range(0, len(samples), repeat)]
    return ProduceResult.of(groups, produce_time_s=time.perf_counter() - started, launched_s=launched_s)


def produce_summary(result: ProduceResult) -> dict[str, float]:
    """The few numbers of a produced batch that travel to the orchestrator and the metrics."""
    samples = [s for group in result.groups for s in group]
    return {
        "produce_time_s": result.produce_time_s,
        "launched_s": result.launched_s,
        "produced_samples": float(result.produced_samples),
        "produced_tokens": float(result.produced_tokens),
        "failed_samples": float(result.failed_samples),
        "policy_version": float(samples[0].policy_version if samples else 0),
        **{f"trajectory/{k}": v for k, v in trajectory_summary(samples).items()},
    }
