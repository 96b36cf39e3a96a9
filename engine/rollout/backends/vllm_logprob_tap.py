"""The sampled tokens' logprobs, read where vLLM samples them instead of through its per-request outputs.

Asking vLLM for ``logprobs=0`` cost the rollout a third of its speed on an H200 (0.5B, 256 x 256 new
tokens: 30.7k against 48.0k tokens/s without, bench/RESULTS.md section 1): the GPU work is small, but
every request's logprob crosses vLLM's output path on every engine step as Python objects. The tap
wraps the sampler of vLLM's V2 model runner (in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and,
for the requests registered with it, keeps the logprob of each sampled token under the processed
logits (what ``logprobs_mode="processed_logprobs"`` returns, computed by vLLM's own kernel), keyed by
request and position. Each step costs one small device-to-host copy, made without waiting.

Keyed by position, the record is right whatever the scheduler did: a chunked prefill's rows sit before
the prompt's last position, a request scheduled one step past its end (asynchronous scheduling) sits
after its last token, and a recomputed position (preemption) overwrites itself.
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable

import torch

_DRAIN_AFTER = 256  # steps kept on the host before their values are filed


class SampledLogprobTap:
    def __init__(self, sampler, token_logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """``sampler``: vLLM's V2 ``Sampler``; ``token_logprobs(logits, token_ids [N, 1]) -> [N, 1]``."""
        self._sampler = sampler
        self._original = sampler.sample
        self._token_logprobs = token_logprobs
        self._wanted: dict[str, dict[int, float]] = {}  # request id -> {position: logprob}
        self._pending: list[tuple[list[str | None], torch.Tensor, torch.cuda.Event | None]] = []
        sampler.sample = self._sample

    @classmethod
    def install(cls, llm, token_logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> SampledLogprobTap | None:
        """On an in-process engine with vLLM's V2 model runner; None elsewhere (the caller then asks vLLM
        for logprobs the usual way). ``token_logprobs``: vLLM's ``compute_token_logprobs``."""
        try:
            runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        except AttributeError:
            return None
        sampler = getattr(runner, "sampler", None)
        if sampler is None or not hasattr(getattr(sampler, "req_states", None), "index_to_req_id"):
            return None
        if not {"logits", "idx_mapping_np", "pos"} <= inspect.signature(sampler.sample).parameters.keys():
            return None
        return cls(sampler, token_logprobs)

    def register(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._wanted[request_id] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._wanted.pop(request_id, None)

    def take(self, request_id: str, first_position: int, count: int) -> list[float]:
        """The logprobs of the request's first ``count`` sampled tokens; the first was sampled from the
        logits at ``first_position`` (the prompt's last position). Forgets the request."""
        self._drain()
        by_position = self._wanted.pop(request_id, {})
        missing = [j for j in range(count) if first_position + j not in by_position]
        if missing:
            raise RuntimeError(f"vLLM request {request_id}: no sampled logprob recorded for {len(missing)} of its "
                               f"{count} tokens (first missing: token {missing[0]}).")
        return [by_position[first_position + j] for j in range(count)]

    def _sample(self, logits, expanded_idx_mapping, idx_mapping_np, pos, *args, **kwargs):
        sampled, processed = self._original(logits, expanded_idx_mapping, idx_mapping_np, pos, *args, **kwargs)
        if self._wanted and processed.shape[0] == len(idx_mapping_np):
            names = self._sampler.req_states.index_to_req_id
            ids = [names.get(index) for index in idx_mapping_np.tolist()]
            if any(request_id in self._wanted for request_id in ids):
                self._record(ids, self._token_logprobs(processed, sampled.view(-1, 1))[:, 0], pos)
        return sampled, processed

    def _record(self, ids: list[str | None], logprobs: torch.Tensor, positions: torch.Tensor) -> None:
        rows = torch.stack((logprobs.float(), positions.to(torch.float32)))  # positions are exact below 2**24
        if rows.is_cuda:
            host = torch.empty(rows.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = rows.clone(), None
        self._pending.append((ids, host, event))
        if len(self._pending) > _DRAIN_AFTER:
            self._drain(keep=2)  # the latest steps may still be running: leave them

    def _drain(self, keep: int = 0) -> None:
        done = len(self._pending) - keep
        filed, self._pending = self._pending[:done], self._pending[done:]
        for ids, host, event in filed:
            if event is not None:
                event.synchronize()
            values, positions = host.tolist()
            for request_id, value, position in zip(ids, values, positions):
                by_position = self._wanted.get(request_id)
                if by_position is not None:
                    by_position[int(position)] = value
