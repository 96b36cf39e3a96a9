"""Continuing samples' responses in one backend call (the single-turn loop; a batch produced with no
agent loop), and the token budget every loop's sessions live within. Agent loops and batch production
both build on it."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

import torch

from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.rollout.backends.base import Generation, ImagePrompt, RolloutBackend, SamplingParams


def generate(
    samples: list[RolloutSample],
    backend: RolloutBackend,
    params: SamplingParams,
    decode: Callable[[list[int]], str] | None = None,
) -> None:
    """Generate the rest of each sample's response in one backend call: from the prompt, or, for a
    sample a pause interrupted (partial rollout), from the prompt and the tokens it already has,
    within what is left of its budget (``params.max_new_tokens``, or the prompt's own cap below it).
    New tokens carry the backend's policy version; a sample interrupted again stays ABORTED, with
    what it has. ``decode`` turns a continued sample's whole response into text (texts of two halves
    need not join up at a token boundary)."""
    if not samples:
        return
    lefts, step_params = _budgets(samples, params)
    started = time.time()
    generations = backend.generate([backend_prompt(s) for s in samples], step_params, lefts)
    ended = time.time()
    for sample, generation, left in zip(samples, generations, lefts):
        extend(sample, generation, left, backend.policy_version, decode)
        sample.timings.append(("generate", started, ended, {"tokens": len(generation.response_ids[:left]), "finish_reason": generation.finish_reason}))


def backend_prompt(sample: RolloutSample) -> list[int]:
    """What a backend continues: the prompt and the response so far, with the prompt's images."""
    ids = sample.prompt_ids + sample.response_ids
    return ImagePrompt(ids, sample.images) if sample.images else ids


def generate_streaming(
    samples: list[RolloutSample],
    backend: RolloutBackend,
    params: SamplingParams,
    decode: Callable[[list[int]], str] | None = None,
) -> Iterator[RolloutSample]:
    """As ``generate``, yielding each sample as soon as it ends (stopped, capped or interrupted)."""
    if not samples:
        return
    lefts, step_params = _budgets(samples, params)
    version, started = backend.policy_version, time.time()
    for index, generation in backend.stream([backend_prompt(s) for s in samples], step_params, lefts):
        extend(samples[index], generation, lefts[index], version, decode)
        samples[index].timings.append(("generate", started, time.time(), {
            "tokens": len(generation.response_ids[:lefts[index]]), "finish_reason": generation.finish_reason}))
        yield samples[index]


def _budgets(samples: list[RolloutSample], params: SamplingParams) -> tuple[list[int], SamplingParams]:
    lefts = [max(1, budget_of(s, params) - len(s.response_ids)) for s in samples]
    return lefts, dataclasses.replace(params, max_new_tokens=max(lefts))


def extend(
    sample: RolloutSample, generation: Generation, left: int, version: int, decode: Callable[[list[int]], str] | None
) -> None:
    """Append ``generation`` (at most ``left`` tokens, made by policy ``version``) to ``sample``."""
    continued = bool(sample.response_ids)
    if not continued:  # a fresh start: the response begins with the current policy
        sample.policy_version = version
    new_ids, new_logprobs = generation.response_ids[:left], generation.logprobs[:left]
    earlier_versions = sample.response_versions or [sample.policy_version] * len(sample.response_ids)
    sample.response_versions = earlier_versions + [version] * len(new_ids)
    sample.response_ids = sample.response_ids + new_ids
    sample.logprobs = sample.logprobs + new_logprobs
    sample.routed_experts = _joined_routing(sample, generation.routed_experts, left, continued)
    if not continued:
        sample.response = generation.text
    else:
        sample.response = decode(sample.response_ids) if decode is not None else sample.response + generation.text
    truncated = len(generation.response_ids) > left
    sample.finish_reason = "length" if truncated else generation.finish_reason
    sample.status = Status.ABORTED if sample.finish_reason == "abort" else Status.COMPLETED


def _joined_routing(sample: RolloutSample, new: torch.Tensor | None, left: int, continued: bool) -> torch.Tensor | None:
    """A continued response keeps the routing its earlier tokens got from the engine that made them;
    if either part has none, the response has none (training then routes it itself)."""
    if new is None or (continued and sample.routed_experts is None):
        return None
    new = new[:left]
    return torch.cat([sample.routed_experts, new]) if continued else new


def budget_of(sample: RolloutSample, params: SamplingParams) -> int:
    """A sample's cap on response tokens: the run's, or its prompt's own when that is smaller."""
    return min(params.max_new_tokens, sample.max_new_tokens or params.max_new_tokens)
