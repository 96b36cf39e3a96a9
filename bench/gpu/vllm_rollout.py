"""Rollout through trellis's vLLM backend against bare vLLM (the same engine, called directly) and the
transformers loop; weight sync trainer -> vLLM; sleep / wake times. Random-init Qwen2-0.5B shape, bf16,
128 prompt + 256 new tokens, sampled at T=1 with logprobs (logprobs=0 on both sides), 6 alternated
rounds per batch size, each round's ratio from its back-to-back pair; median and min/max printed.

    python bench/gpu/vllm_rollout.py OUT_DIR

Prints one JSON object and writes it to OUT_DIR/vllm_rollout.json.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_steps import random_qwen2_05b  # noqa: E402

from trellis.engine.rollout.backends.base import SamplingParams  # noqa: E402
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout  # noqa: E402
from trellis.engine.rollout.backends.vllm_backend import VllmRollout  # noqa: E402
from trellis.engine.tiny.model import build_tokenizer  # noqa: E402

PROMPT, NEW = 128, 256
ROUNDS = 6


def prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT)] for _ in range(batch)]


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started, result


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model_dir = random_qwen2_05b(tokenizer, Path("/tmp/trellis-gpu/qwen2-05b-random"))
    vocab = len(tokenizer)
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=1)
    result: dict[str, object] = {"prompt_tokens": PROMPT, "new_tokens": NEW}

    started = time.perf_counter()
    backend = VllmRollout(str(model_dir), tokenizer, gpu_memory_utilization=0.45, max_model_len=PROMPT + NEW)
    result["vllm_init_s"] = time.perf_counter() - started
    from vllm import SamplingParams as VllmParams

    def bare(batch_prompts):
        requests = [{"prompt_token_ids": p} for p in batch_prompts]
        sampling = [
            VllmParams(max_tokens=NEW, temperature=1.0, seed=i + 1, logprobs=0, detokenize=False)
            for i in range(len(batch_prompts))
        ]
        return backend._llm.generate(requests, sampling, use_tqdm=False)

    backend.generate(prompts(16, vocab, 0), params)  # warm-up
    bare(prompts(16, vocab, 1))
    for batch in (64, 256):
        ours, theirs = [], []
        for round_index in range(ROUNDS):  # alternate, so drift hits both alike
            # Fresh prompts for every call: a repeated prompt would be served from the prefix cache.
            ours_prompts, bare_prompts = prompts(batch, vocab, 100 + 2 * round_index), prompts(batch, vocab, 101 + 2 * round_index)
            seconds, generations = timed(lambda: backend.generate(ours_prompts, params))
            ours.append(sum(len(g.response_ids) for g in generations) / seconds)
            seconds, outputs = timed(lambda: bare(bare_prompts))
            theirs.append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
        ratios = [a / b for a, b in zip(ours, theirs)]  # each round's pair ran back to back
        result[f"bs{batch}"] = {
            "rounds": ROUNDS,
            "trellis_vllm_tok_s": statistics.median(ours),
            "trellis_vllm_tok_s_min_max": [min(ours), max(ours)],
            "bare_vllm_tok_s": statistics.median(theirs),
            "bare_vllm_tok_s_min_max": [min(theirs), max(theirs)],
            "ratio_trellis_vs_bare": statistics.median(ratios),
            "ratio_min_max": [min(ratios), max(ratios)],
        }

    # Weight sync from a trainer-like fp32 copy on the same GPU, then the sleep / wake switch.
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    probe = prompts(4, vocab, 7)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    before = [g.response_ids for g in backend.generate(probe, greedy)]
    with torch.no_grad():
        for parameter in trainer.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    weights = trainer.state_dict()
    sync = []
    for _ in range(3):
        seconds, _ = timed(lambda: backend.load_weights(weights, policy_version=1))
        sync.append(seconds)
    changed = [g.response_ids for g in backend.generate(probe, greedy)] != before
    switch = {"sleep_s": [], "wake_s": [], "sync_while_asleep_s": []}
    for _ in range(3):
        switch["sleep_s"].append(timed(backend.offload)[0])
        switch["sync_while_asleep_s"].append(timed(lambda: backend.load_weights(weights, 2))[0])
        switch["wake_s"].append(timed(backend.onload)[0])
    result["weight_sync"] = {
        "tensors": len(weights),
        "gb_fp32": sum(t.numel() * 4 for t in weights.values()) / 1e9,
        "median_s": statistics.median(sync),
        "outputs_changed": changed,
    }
    result["switch"] = {k: statistics.median(v) for k, v in switch.items()}
    del trainer
    weights = None  # the state dict holds the trainer's GPU tensors too
    backend.offload()
    torch.cuda.empty_cache()

    transformers = TransformersRollout(str(model_dir), tokenizer, device="cuda", dtype=torch.bfloat16)
    batch_prompts = prompts(64, vocab, 200)
    transformers.generate(prompts(8, vocab, 1), SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))
    seconds, generations = timed(lambda: transformers.generate(batch_prompts, params))
    result["bs64"]["transformers_tok_s"] = sum(len(g.response_ids) for g in generations) / seconds
    result["bs64"]["ratio_trellis_vllm_vs_transformers"] = result["bs64"]["trellis_vllm_tok_s"] / result["bs64"]["transformers_tok_s"]

    (out / "vllm_rollout.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
    import os

    os._exit(0)  # vLLM's engine threads would hold the process open
