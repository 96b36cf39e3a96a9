"""An interrupted vLLM response keeps its routing (partial rollout with routing replay).

The tiny MoE without its warm-up (random routing is as real as trained), greedy, 64 random prompts:
half may write 8 tokens, half 64. Run A is interrupted as soon as the first response ends (the 64-token
ones are then cut at ~9 tokens); run B lets every response end. For each interrupted response of A:
its routing must be there, [tokens, layers, k], and equal to B's at the same positions (greedy, so the
tokens are the same; the share of equal top-k sets is reported). Writes OUT/vllm_abort_routing.json.

    python bench/gpu/vllm_abort_routing.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from trellis.engine.rollout.backends.base import SamplingParams
from trellis.engine.rollout.backends.vllm_backend import VllmRollout
from trellis.engine.tiny.model import build_tokenizer
from trellis.engine.tiny.moe import build_moe_model


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    folder, tokenizer = Path("/tmp/trellis-gpu/tiny-moe-raw"), build_tokenizer()
    if not (folder / "config.json").exists():
        build_moe_model(tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    backend = VllmRollout(str(folder), tokenizer, gpu_memory_utilization=0.2, capture_routing=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(8, len(tokenizer), (12,), generator=generator).tolist() for _ in range(64)]
    limits = [8 if i % 2 else 64 for i in range(64)]
    params = SamplingParams(max_new_tokens=64, temperature=0.0)

    interrupted = {}
    for index, generation in backend.stream(prompts, params, limits):
        if generation.finish_reason != "abort":
            backend.abort()  # the first response to end interrupts the rest at the next engine step
        else:
            interrupted[index] = generation
    backend.resume_generation()
    finished = dict(backend.stream(prompts, params, limits))

    with_routing = [i for i, g in interrupted.items() if g.routed_experts is not None]
    equal_sets = compared = same_tokens = 0
    for i in with_routing:
        partial, whole = interrupted[i], finished[i]
        n = len(partial.response_ids)
        same_tokens += partial.response_ids == whole.response_ids[:n]
        a, b = partial.routed_experts, whole.routed_experts[:n]
        assert a.shape == b.shape, (a.shape, b.shape)
        equal_sets += int((a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1).sum())
        compared += a.shape[0] * a.shape[1]
    result = {
        "interrupted": len(interrupted), "interrupted_with_routing": len(with_routing),
        "tokens_per_interrupted_response": sorted({len(g.response_ids) for g in interrupted.values()}),
        "routing_shape_example": list(interrupted[with_routing[0]].routed_experts.shape) if with_routing else None,
        "same_tokens_as_the_finished_run": same_tokens, "equal_topk_sets_share": equal_sets / compared if compared else None,
    }
    (out / "vllm_abort_routing.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads would hold the process open
