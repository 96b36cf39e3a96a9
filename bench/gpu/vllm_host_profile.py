"""Where the host time of one vLLM rollout goes, function by function (cProfile), through trellis's own
backend (``VllmRollout``, the logprob tap on): random-init Qwen2-0.5B shape, 256 prompts of 128 tokens,
256 new tokens, T=1.

A warm-up rollout, then 3 pairs of rollouts with and without a seed per request (what trellis asks; the
pair shows what the seed costs), then one profiled rollout, whose tables (by own time, by cumulative time)
go to stdout. cProfile slows many small Python calls most: read the tables for where the time goes, not
for how much the unprofiled rollout takes.

    python bench/gpu/vllm_host_profile.py > OUT/profile.log
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import random
import time
from pathlib import Path

from trellis.engine.rollout.backends.base import SamplingParams
from trellis.engine.rollout.backends.vllm_backend import VllmRollout
from trellis.engine.tiny.model import build_tokenizer

MODEL = Path("/tmp/trellis-gpu/qwen2-05b-random")


def main() -> None:
    if not (MODEL / "config.json").exists():
        from engine_steps import random_qwen2_05b

        random_qwen2_05b(build_tokenizer(), MODEL)
    backend = VllmRollout(str(MODEL), build_tokenizer(), gpu_memory_utilization=0.3)

    def rollout(seed: int, seeded: bool = True) -> float:
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, 1000) for _ in range(128)] for _ in range(256)]
        params = SamplingParams(max_new_tokens=256, seed=seed if seeded else None)
        started = time.perf_counter()
        tokens = sum(len(g.response_ids) for _, g in backend.stream(prompts, params))
        return tokens / (time.perf_counter() - started)

    rollout(0)
    for i in range(3):
        print("tok/s: seed per request", round(rollout(10 + i)), "no seed", round(rollout(20 + i, seeded=False)), flush=True)
    profile = cProfile.Profile()
    profile.enable()
    speed = rollout(99)
    profile.disable()
    print("profiled rollout tok/s", round(speed))
    for order in ("tottime", "cumtime"):
        table = io.StringIO()
        pstats.Stats(profile, stream=table).sort_stats(order).print_stats(45)
        print(table.getvalue())


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads would hold the process open
