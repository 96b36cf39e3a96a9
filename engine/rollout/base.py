"""The rollout backend contract: every backend (transformers, vLLM) takes token ids in and returns
response token ids, their logprobs under the sampling policy, text and a finish reason out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping, Protocol, Sequence

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings; ``temperature == 0`` means greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class Generation:
    """One sampled response. ``logprobs[i]`` is the log-probability of ``response_ids[i]`` under the
    distribution it was sampled from (logits / temperature; raw logits when greedy)."""

    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    extra: dict[str, object] = field(default_factory=dict)


class RolloutBackend(Protocol):
    @property
    def policy_version(self) -> int:
        """The trainer step whose weights this backend serves (0 = the initial checkpoint)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        ...

    def offload(self) -> None:
        """Release accelerator memory (weights and KV cache) so the trainer can use it."""
        ...

    def onload(self) -> None:
        ...
