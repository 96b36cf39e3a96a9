"""Which weights generated a sample: recompute its logprobs teacher-forced and compare."""

from __future__ import annotations

import torch

from trellis.engine.algo.losses import token_logprobs


def teacher_forced_gaps(model, prompts, generations, temperature):
    """|logprob| gaps, token by token, between what generated ``generations`` and ``model`` teacher-forced on them."""
    gaps = []
    for prompt, generation in zip(prompts, generations):
        ids = torch.tensor([prompt + generation.response_ids[:-1]])
        labels = torch.tensor([[-100] * (len(prompt) - 1) + generation.response_ids])
        with torch.no_grad():
            expected = token_logprobs(model(input_ids=ids).logits, labels, temperature=temperature)[0, len(prompt) - 1 :]
        gaps.append((torch.tensor(generation.logprobs) - expected).abs())
    return torch.cat(gaps)
