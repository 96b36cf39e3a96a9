"""The record every rollout produces: one ``RolloutSample`` per sampled response.

It is what the replay buffer holds, what data preparation consumes and what the trajectory lake
stores (one Parquet row each).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from trellis.engine.vision.images import PromptImage


class Status(str, Enum):
    COMPLETED = "completed"
    FAILED = "failed"  # the reward function or the backend failed on this sample
    FILTERED = "filtered"  # dropped on purpose by a filter
    ABORTED = "aborted"  # generation was stopped before it finished (e.g. a partial async rollout)


@dataclass
class RolloutSample:
    rollout_id: str
    group_id: str
    session_id: str
    prompt_index: int
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    label: Any
    data_source: str
    task_name: str
    extra: dict[str, Any] = field(default_factory=dict)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    response: str = ""
    finish_reason: str = ""
    response_mask: list[int] | None = None  # 0 marks tokens not trained on (tool output, masked off-policy tokens)
    response_versions: list[int] = field(default_factory=list)  # policy version that generated each response token
    # MoE policies: the experts the rollout engine routed each response token through, [R, layers, K]
    # (entry j: the forward that predicted token j); None for a dense model or when not captured.
    routed_experts: torch.Tensor | None = None
    status: Status = Status.COMPLETED
    error: str | None = None
    reward: float | None = None
    reward_payload: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0  # the policy that began the response (its oldest token's)
    train_step: int = 0
    epoch: int = 0  # of the prompt sampler, when the prompt was drawn
    max_new_tokens: int | None = None  # the prompt's own cap on response tokens (None: the run's)
    # A multi-turn session (engine.rollout.agents): its turns as token spans of the response, its
    # tool calls, why it ended and its last assistant turn. None for a single response.
    agent: dict[str, Any] | None = None
    # A vision-language prompt's images, in the order of its placeholders.
    images: list[PromptImage] = field(default_factory=list)
    # What the sample went through, for tracing (engine.run.tracing): (what, wall start, wall end, attributes)
    # for its generation, each agent turn and its reward. Never in the lake, never compared.
    timings: list[tuple[str, float, float, dict[str, Any]]] = field(default_factory=list, compare=False, repr=False)

    @property
    def oldest_version(self) -> int:
        return min(self.response_versions) if self.response_versions else self.policy_version

    def reward_input(self) -> dict[str, Any]:
        """What a reward function sees; for a multi-turn session ``response`` is its last assistant turn,
        and ``turns`` and ``tool_calls`` say how it got there."""
        sample = {
            **self.extra,
            "prompt": self.messages,
            "response": self.response,
            "label": self.label,
            "data_source": self.data_source,
            "task_name": self.task_name,
        }
        if self.agent is not None:
            sample.update(
                response=self.agent["final_response"], turns=self.agent["turns"], tool_calls=self.agent["tool_calls"],
                stop_reason=self.agent["stop_reason"],
            )
        return sample

    def fail(self, error: str) -> None:
        self.status = Status.FAILED
        self.error = error

    def filter_out(self, reason: str) -> None:
        self.status = Status.FILTERED
        self.error = reason

    @property
    def generated_tokens(self) -> int:
        """Response tokens the policy generated (tool output, masked with 0, excluded)."""
        return sum(self.response_mask) if self.response_mask is not None else len(self.response_ids)
