"""vLLM forgets what the old weights computed when new ones are loaded (GPU only; vLLM does not run here).

vLLM's prefix cache hands a request the KV blocks of any earlier request that shared its prefix. After a weight
sync with the engine awake (``rollout.sleep_level: auto`` keeps it awake through the fit where the fit fits
beside it; a disaggregated engine never sleeps), a partial response continued with the new weights would attend
to the old weights' keys and values. Tried on an H100 with vLLM 0.26, the load without the cache drop: every
continued request was served 16 cached tokens, and its logprobs moved by up to 0.04 against a recompute."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.engine.rollout.backends.base import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None, reason="needs vLLM and a GPU"),
]


def test_no_request_after_a_weight_load_is_served_kv_blocks_cached_before_it(tiny_model):
    from vllm import SamplingParams as VllmSamplingParams

    from trellis.engine.rollout.backends.vllm_backend import VllmRollout

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"reverse {word}"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for word in ["ABC", "QWERT", "XYZW", "MNOPQR"]]
    backend = VllmRollout(str(tiny_model), tokenizer, gpu_memory_utilization=0.3, sleep_level=0)
    first = backend.generate(prompts, SamplingParams(max_new_tokens=40, temperature=1.0, seed=5))
    continued = [{"prompt_token_ids": list(prompt) + generation.response_ids} for prompt, generation in zip(prompts, first)]
    greedy = VllmSamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
    again = backend._llm.generate(continued, greedy, use_tqdm=False)
    assert all(output.num_cached_tokens >= 16 for output in again), "the engine caches prefixes (else this test shows nothing)"

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.01)
    backend.load_weights(model.state_dict(), policy_version=1)
    after = backend._llm.generate(continued, greedy, use_tqdm=False)
    assert [output.num_cached_tokens for output in after] == [0] * len(continued)
