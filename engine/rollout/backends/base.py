"""The rollout backend contract: every backend (transformers, vLLM) takes token ids in (with their
images, for a vision-language policy: ``ImagePrompt``) and returns response token ids, their
logprobs under the sampling policy, text and a finish reason out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Literal, Mapping, Protocol, Sequence

import torch

from trellis.engine.weights.attestation import WeightIntake

FinishReason = Literal["stop", "length", "abort"]


class ImagePrompt(list):
    """A vision-language prompt: its token ids (each image's placeholder expanded to its token count)
    with the images they stand for (``engine.vision.images.PromptImage``). A plain list of ids
    everywhere else, so text backends and callers see no difference."""

    def __init__(self, token_ids: Sequence[int], images: Sequence[object]) -> None:
        super().__init__(token_ids)
        self.images = tuple(images)


def prompt_images(prompt: Sequence[int]) -> tuple:
    return getattr(prompt, "images", ())


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
    # [R, MoE layers, K] expert ids of the forward that predicted each response token, where the
    # backend was asked to capture routing (an MoE policy); None otherwise.
    routed_experts: torch.Tensor | None = None


class RolloutBackend(Protocol):
    @property
    def policy_version(self) -> int:
        """The trainer step whose weights this backend serves (0 = the initial checkpoint)."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> list[Generation]:
        """One generation per prompt. ``limits[i]`` (at most ``params.max_new_tokens``) caps prompt i's
        new tokens; a sample that reaches its cap ends with ``finish_reason`` "length"."""
        ...

    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> Iterator[tuple[int, Generation]]:
        """As ``generate``, but each (prompt index, generation) comes as soon as that sample ends,
        so a caller can use finished groups while the long ones go on."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        ...

    @property
    def intake(self) -> WeightIntake:
        """What the last weight sync brought, and whether the run has attested it (``engine.weights.attestation``)."""
        ...

    def score_tokens(self, token_ids: Sequence[int]) -> list[float]:
        """The logprob of each token after the first given those before it, at temperature 1 (the
        attestation's canary): one forward, nothing sampled."""
        ...

    def offload(self) -> None:
        """Release accelerator memory (weights and KV cache) so the trainer can use it."""
        ...

    def onload(self) -> None:
        ...

    def abort(self) -> None:
        """From another thread: stop generating soon; unfinished samples return what they have,
        with ``finish_reason`` "abort", and later calls return at once, until ``resume_generation``."""
        ...

    def resume_generation(self) -> None:
        ...


class StreamingBackend:
    """What the backends share: the policy version they serve (``load_weights`` sets it), the record of
    the weights they took in (a backend's ``stream`` starts with ``self.intake.refuse_if_held()``: no
    rollout with unattested weights), and ``generate`` as their ``stream`` put in prompt order. Aborting
    is a capability of its own (the registry's ``supports_abort``): a backend that has it writes
    ``abort`` and ``resume_generation``."""

    def __init__(self) -> None:
        self._policy_version = 0
        self._intake = WeightIntake()
        self.last_step_s = time.monotonic()  # when generation last advanced a decode step (the health check's stall clock)

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def intake(self) -> WeightIntake:
        return self._intake

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> list[Generation]:
        return in_order(self.stream(prompts, params, limits), len(prompts))

    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> Iterator[tuple[int, Generation]]:
        raise NotImplementedError


def in_order(stream: Iterable[tuple[int, Generation]], count: int) -> list[Generation]:
    """The generations of a ``stream`` over ``count`` prompts, in prompt order."""
    generations: list[Generation | None] = [None] * count
    for index, generation in stream:
        generations[index] = generation
    missing = [i for i, g in enumerate(generations) if g is None]
    if missing:
        raise RuntimeError(f"The rollout backend returned no generation for prompts {missing[:5]} of {count}.")
    return generations  # type: ignore[return-value]
