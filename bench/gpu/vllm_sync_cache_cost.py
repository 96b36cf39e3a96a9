"""What dropping vLLM's prefix cache at each weight load costs, on the engine of the TRL comparison.

``VllmRollout.load_weights`` drops the prefix cache (the old weights' KV blocks) after loading: vLLM walks
every KV block of the engine to clear its hash. One engine in this process, random-init Qwen2-0.5B shape,
``--memory`` of the GPU, awake throughout (``sleep_level`` 0, as ``auto`` keeps it where the fit fits beside);
each round generates a batch (256 prompts of 128 tokens, 256 new), which fills the cache, then loads the
same weights back and times the load, and the cache drop inside it on its own.

    python bench/gpu/vllm_sync_cache_cost.py OUT_DIR [--rounds 6] [--memory 0.4]   (writes OUT_DIR/sync_cache_cost.json)
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
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_steps import random_qwen2_05b  # noqa: E402

from trellis.engine.rollout.backends.base import SamplingParams  # noqa: E402
from trellis.engine.rollout.backends.vllm_backend import VllmRollout  # noqa: E402
from trellis.engine.tiny.model import build_tokenizer  # noqa: E402


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--memory", type=float, default=0.4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model_dir = random_qwen2_05b(tokenizer, Path("/tmp/trellis-gpu/qwen2-05b-random-sync"))
    weights = {name: tensor.cuda() for shard in model_dir.glob("*.safetensors") for name, tensor in load_file(shard).items()}
    backend = VllmRollout(str(model_dir), tokenizer, gpu_memory_utilization=args.memory, sleep_level=0)
    blocks = backend._llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=256, temperature=1.0, seed=1)
    loads, drops, rollouts = [], [], []
    for round_ in range(args.rounds):
        batch = [[rng.randrange(3, 150_000) for _ in range(128)] for _ in range(256)]
        started = time.perf_counter()
        backend.generate(batch, params)
        rollouts.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        started = time.perf_counter()
        backend.load_weights(weights, policy_version=round_ + 1)
        torch.cuda.synchronize()
        loads.append(time.perf_counter() - started)
        backend.generate(batch[:64], params)  # cached blocks again, for the drop alone
        started = time.perf_counter()
        backend._forget_old_activations()
        drops.append(time.perf_counter() - started)
        print(f"round {round_ + 1}: rollout {rollouts[-1]:.2f} s, load with the drop {loads[-1] * 1e3:.1f} ms, "
              f"the drop alone {drops[-1] * 1e3:.1f} ms", flush=True)
    result = {"kv_blocks": blocks, "gpu_memory_utilization": args.memory, "rollout_s": spread(rollouts),
              "load_weights_s": spread(loads), "prefix_cache_drop_s": spread(drops),
              "card": torch.cuda.get_device_name()}
    (args.out / "sync_cache_cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
