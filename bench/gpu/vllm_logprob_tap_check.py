"""The sampled-logprob tap (``engine/rollout/backends/vllm_logprob_tap.py``) against vLLM's own logprobs,
on one engine: the same prompts and per-request seeds through trellis's ``stream`` with the tap, then
with the tap off (vLLM's ``logprobs=0`` path), and the rollout's speed with each, alternated.

Random-init Qwen2-0.5B shape, 256 prompts of 128 tokens, 256 new tokens, T=1 (the step's rollout in the
TRL and verl comparisons); the agreement check also runs per-sample limits (1..256 tokens) and a pause
(``abort``) in the middle of a generation, whose partial responses must carry one logprob per token.

    python bench/gpu/vllm_logprob_tap_check.py OUT_DIR [--rounds 4]     (writes OUT_DIR/logprob_tap.json)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_steps import random_qwen2_05b  # noqa: E402

from trellis.engine.rollout.backends.base import SamplingParams  # noqa: E402
from trellis.engine.rollout.backends.vllm_backend import VllmRollout  # noqa: E402
from trellis.engine.tiny.model import build_tokenizer  # noqa: E402

PROMPT, NEW, BATCH = 128, 256, 256


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT)] for _ in range(count)]


def run(backend: VllmRollout, tap, batch, params, limits=None, abort_after_s: float | None = None):
    backend._tap = tap
    if abort_after_s is not None:
        threading.Timer(abort_after_s, backend.abort).start()
    torch.cuda.synchronize()
    started = time.perf_counter()
    generations = backend.generate(batch, params, limits=limits) if limits is not None else backend.generate(batch, params)
    elapsed = time.perf_counter() - started
    backend.resume_generation()
    return generations, elapsed


def agreement(tapped, plain) -> dict:
    same_tokens = [(a, b) for a, b in zip(tapped, plain) if a.response_ids == b.response_ids]
    diffs = [abs(x - y) for a, b in same_tokens for x, y in zip(a.logprobs, b.logprobs)]
    return {
        "samples": len(tapped), "samples_with_equal_tokens": len(same_tokens),
        "tokens_compared": len(diffs), "max_abs_logprob_diff": max(diffs) if diffs else None,
        "mean_abs_logprob_diff": statistics.mean(diffs) if diffs else None,
        "every_sample_one_logprob_per_token": all(len(g.logprobs) == len(g.response_ids) for g in tapped),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model_dir = random_qwen2_05b(tokenizer, Path("/tmp/trellis-gpu/qwen2-05b-random"))
    vocab = len(tokenizer)
    backend = VllmRollout(str(model_dir), tokenizer, gpu_memory_utilization=0.4, max_model_len=PROMPT + NEW)
    tap = backend._tap
    result: dict = {"tap_installed": tap is not None, "device": torch.cuda.get_device_name()}
    if tap is None:
        (args.out / "logprob_tap.json").write_text(json.dumps(result, indent=1))
        raise SystemExit("the tap did not install on this vLLM")
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=7)
    run(backend, tap, prompts(16, vocab, 0), params)
    run(backend, None, prompts(16, vocab, 0), params)  # warm-up of both paths

    batch = prompts(BATCH, vocab, 1)
    result["full_length"] = agreement(run(backend, tap, batch, params)[0], run(backend, None, batch, params)[0])
    limits = [1 + (i * 37) % NEW for i in range(BATCH)]
    result["per_sample_limits"] = agreement(run(backend, tap, batch, params, limits)[0], run(backend, None, batch, params, limits)[0])
    aborted, _ = run(backend, tap, prompts(BATCH, vocab, 2), params, abort_after_s=0.5)
    result["aborted"] = {
        "samples": len(aborted), "aborted": sum(g.finish_reason == "abort" for g in aborted),
        "tokens": sum(len(g.response_ids) for g in aborted),
        "one_logprob_per_token": all(len(g.logprobs) == len(g.response_ids) for g in aborted),
        "all_finite_and_not_positive": all(math.isfinite(x) and x <= 1e-6 for g in aborted for x in g.logprobs),
    }

    tok_s: dict[str, list[float]] = {"tap": [], "vllm_logprobs": []}
    seed = 100
    for round_index in range(args.rounds):
        for side in ("tap", "vllm_logprobs") if round_index % 2 == 0 else ("vllm_logprobs", "tap"):
            seed += 1  # fresh prompts: a repeated prompt would be served from the prefix cache
            generations, elapsed = run(backend, tap if side == "tap" else None, prompts(BATCH, vocab, seed), params)
            tok_s[side].append(sum(len(g.response_ids) for g in generations) / elapsed)
    result["rollout_tok_s"] = {side: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v} for side, v in tok_s.items()}
    pairs = [t / v for t, v in zip(tok_s["tap"], tok_s["vllm_logprobs"])]
    result["tap_vs_vllm_logprobs_by_round"] = {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs), "all": pairs}
    (args.out / "logprob_tap.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads would hold the process open
