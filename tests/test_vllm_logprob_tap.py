"""The sampled-logprob tap's bookkeeping, on CPU: vLLM's V2 sampler is stood in for by a class with its
``sample`` signature and request table (vLLM does not run here; the tap against vLLM's own logprobs is
measured on the H200: bench/gpu/vllm_logprob_tap_check.py). What was tried: rows of a chunked prefill,
a request scheduled one step past its end, a recomputed position, rows of requests nobody registered,
a forgotten request, a position never sampled, and more steps than the tap keeps pending."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trellis.engine.rollout.backends.vllm_logprob_tap import SampledLogprobTap


class _RequestTable:
    def __init__(self) -> None:
        self.index_to_req_id: dict[int, str] = {}


class _FakeSampler:
    """vLLM's V2 ``Sampler.sample`` contract: returns the sampled ids and the processed logits."""

    def __init__(self) -> None:
        self.req_states = _RequestTable()
        self.next_tokens: torch.Tensor | None = None

    def sample(self, logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids, expanded_local_pos, return_logprobs=False):
        return self.next_tokens, logits * 0.5  # "processed": a temperature of 2


def _token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, token_ids)


def _step(sampler: _FakeSampler, slots: list[int], positions: list[int], tokens: list[int], seed: int) -> torch.Tensor:
    """One engine step over the request slots ``slots``; returns the expected logprobs of its rows."""
    logits = torch.randn(len(slots), 11, generator=torch.Generator().manual_seed(seed))
    sampler.next_tokens = torch.tensor(tokens)
    sampler.sample(logits, None, np.array(slots), torch.tensor(positions), None, None)
    return _token_logprobs(logits * 0.5, torch.tensor(tokens).view(-1, 1))[:, 0]


@pytest.fixture
def tapped():
    sampler = _FakeSampler()
    tap = SampledLogprobTap(sampler, _token_logprobs)
    sampler.req_states.index_to_req_id.update({0: "a", 1: "b", 2: "stranger"})
    return sampler, tap


def test_each_request_gets_its_sampled_logprobs_in_position_order(tapped):
    sampler, tap = tapped
    tap.register(["a", "b"])  # prompt lengths: a 3 tokens (first logits at position 2), b 5 (position 4)
    b_chunk = _step(sampler, [0, 1, 2], [2, 1, 7], [4, 9, 1], seed=1)  # b still prefilling: its row is at position 1
    a_and_b = _step(sampler, [0, 1, 2], [3, 4, 8], [5, 6, 2], seed=2)
    redo = _step(sampler, [0, 1], [4, 5], [3, 7], seed=3)  # a's position 4 recomputed (preemption)
    past_end = _step(sampler, [0, 1], [5, 6], [1, 1], seed=4)  # scheduled one step past each request's end

    a = tap.take("a", 2, 3)
    assert a == pytest.approx([b_chunk[0].item(), a_and_b[0].item(), redo[0].item()])
    b = tap.take("b", 4, 2)
    assert b == pytest.approx([a_and_b[1].item(), redo[1].item()])
    assert past_end.numel() == 2  # rows past the end were recorded and left out of both answers


def test_rows_of_others_and_forgotten_requests_are_not_kept(tapped):
    sampler, tap = tapped
    tap.register(["a", "b"])
    _step(sampler, [0, 1, 2], [2, 4, 9], [1, 2, 3], seed=5)
    tap.forget(["b"])
    assert len(tap.take("a", 2, 1)) == 1
    with pytest.raises(RuntimeError, match="vLLM request b: no sampled logprob recorded for 1 of its 1 tokens"):
        tap.take("b", 4, 1)
    with pytest.raises(RuntimeError, match="request stranger"):
        tap.take("stranger", 9, 1)


def test_a_position_never_sampled_is_an_error_not_a_guess(tapped):
    sampler, tap = tapped
    tap.register(["a"])
    _step(sampler, [0], [2], [1], seed=6)
    _step(sampler, [0], [4], [1], seed=7)  # position 3 missing
    with pytest.raises(RuntimeError, match="first missing: token 1"):
        tap.take("a", 2, 3)


def test_a_long_generation_is_filed_as_it_goes(tapped):
    sampler, tap = tapped
    tap.register(["a"])
    expected = [_step(sampler, [0], [2 + j], [j % 11], seed=100 + j)[0].item() for j in range(700)]
    assert len(tap._pending) <= 258  # filed every 256 steps, the latest two left pending
    assert tap.take("a", 2, 700) == pytest.approx(expected)
    _step(sampler, [0], [3], [1], seed=1)
    assert tap._pending == []  # nobody registered: the step records nothing


def test_install_refuses_what_is_not_an_in_process_v2_engine():
    class NoEngine:
        pass

    assert SampledLogprobTap.install(NoEngine(), _token_logprobs) is None
