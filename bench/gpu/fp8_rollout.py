"""FP8 rollout against bf16 rollout, generation alone: two of trellis's vLLM engines in one process on one
GPU, one loading the checkpoint in bf16 and one quantizing it to FP8 (``rollout.quantization: fp8``),
given the same batches in alternated order (A B, then B A, ...) so drift hits both alike.

Random-init Qwen2 shape (``--shape``, 7B by default), 128 random prompt tokens and 256 new tokens a
sample, T=1, logprobs on (as a rollout asks for them), fresh prompts every call (no prefix-cache hits).
Per batch size: each side's tokens/s (median, min, max over the rounds) and each round's FP8 / bf16
ratio from its back-to-back pair. Also the teacher-forced k3 mismatch of the FP8 engine against the
bf16 engine on the same sampled tokens, which separates FP8's own error from the trainer's.

    python bench/gpu/fp8_rollout.py OUT_DIR [--shape 7b] [--rounds 4] [--batches 128 256 512]

Writes OUT_DIR/fp8_rollout_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_steps import QWEN2_SHAPES, random_qwen2_05b  # noqa: E402

from trellis.engine.rollout.backends.base import SamplingParams  # noqa: E402
from trellis.engine.rollout.backends.vllm_backend import VllmRollout  # noqa: E402
from trellis.engine.tiny.model import build_tokenizer  # noqa: E402

PROMPT, NEW = 128, 256


def prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT)] for _ in range(batch)]


def tokens_per_s(engine: VllmRollout, batch_prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    generations = engine.generate(batch_prompts, params)
    seconds = time.perf_counter() - started
    return sum(len(g.response_ids) for g in generations) / seconds, generations


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def k3_against(engine: VllmRollout, batch_prompts: list[list[int]], generations: list) -> float | str:
    """Mean k3 of ``engine``'s teacher-forced logprobs of the sampled tokens against the sampler's own
    (vLLM's prompt logprobs over prompt + response), or the error that stopped it."""
    from vllm import SamplingParams as VllmParams

    requests = [{"prompt_token_ids": list(p) + list(g.response_ids)} for p, g in zip(batch_prompts, generations)]
    try:
        outputs = engine._llm.generate(requests, VllmParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    except Exception as error:  # a diagnostic: the speed figures stand without it
        return f"{type(error).__name__}: {error}"
    terms = []
    for prompt, generation, output in zip(batch_prompts, generations, outputs):
        scored = [output.prompt_logprobs[len(prompt) + i][token].logprob for i, token in enumerate(generation.response_ids)]
        log_ratio = torch.tensor(scored, dtype=torch.float64) - torch.tensor(generation.logprobs, dtype=torch.float64)
        terms.append(torch.exp(log_ratio) - 1 - log_ratio)
    return float(torch.cat(terms).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(QWEN2_SHAPES), default="7b")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--memory", type=float, default=0.4, help="gpu_memory_utilization of each engine")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    model_dir = Path("/tmp/trellis-gpu") / ("qwen2-05b-random" if args.shape == "0.5b" else f"qwen2-{args.shape}-random")
    if not (model_dir / "config.json").exists():
        random_qwen2_05b(tokenizer, model_dir, shape=args.shape)
    vocab = len(tokenizer)
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=1)
    engines, init_s = {}, {}
    for name in ("bf16", "fp8"):
        started = time.perf_counter()
        engines[name] = VllmRollout(str(model_dir), tokenizer, gpu_memory_utilization=args.memory,
                                    max_model_len=PROMPT + NEW + 1, sleep_level=0, quantization="none" if name == "bf16" else "fp8")
        init_s[name] = time.perf_counter() - started
        tokens_per_s(engines[name], prompts(16, vocab, 0), params)  # warm-up

    result: dict[str, object] = {"shape": args.shape, "prompt_tokens": PROMPT, "new_tokens": NEW,
                                 "device": torch.cuda.get_device_name(), "engine_init_s": init_s,
                                 "gpu_memory_utilization_each": args.memory}
    seed = 100
    for batch in args.batches:
        speeds: dict[str, list[float]] = {"bf16": [], "fp8": []}
        ratios, k3 = [], {"fp8_vs_bf16_sampler": [], "bf16_vs_fp8_sampler": []}
        for round_index in range(args.rounds):
            order = ("bf16", "fp8") if round_index % 2 == 0 else ("fp8", "bf16")
            sampled = {}
            for name in order:
                seed += 1
                batch_prompts = prompts(batch, vocab, seed)
                speed, generations = tokens_per_s(engines[name], batch_prompts, params)
                sampled[name] = (batch_prompts, generations)
                speeds[name].append(speed)
            ratios.append(speeds["fp8"][-1] / speeds["bf16"][-1])
            if round_index == 0:
                k3["fp8_vs_bf16_sampler"].append(k3_against(engines["fp8"], *sampled["bf16"]))
                k3["bf16_vs_fp8_sampler"].append(k3_against(engines["bf16"], *sampled["fp8"]))
        result[f"batch_{batch}"] = {
            "rounds": args.rounds,
            "bf16_tok_s": spread(speeds["bf16"]),
            "fp8_tok_s": spread(speeds["fp8"]),
            "fp8_over_bf16_per_round": ratios,
            "fp8_over_bf16": spread(ratios),
            "k3_between_engines": {name: values[0] for name, values in k3.items()},
        }
        print(batch, json.dumps(result[f"batch_{batch}"]), flush=True)
    (args.out / f"fp8_rollout_{args.shape}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
