"""Does vLLM serve the old weights' KV blocks after a weight load? The rollout contract test's tiny model and
prompts on one engine (awake, ``sleep_level`` 0): generate, load perturbed weights, continue each response greedily
with vLLM's prefix cache as the load left it, drop the cache, continue again. Reports the blocks cached before the
load, the tokens served from cache to each continuation both times, and the largest logprob change between them.

    PYTHONPATH=. python bench/gpu/vllm_prefix_cache_probe.py OUT_DIR      (writes OUT_DIR/prefix_cache_probe.json)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.engine.rollout.backends.base import SamplingParams
from trellis.engine.rollout.backends.vllm_backend import VllmRollout
from trellis.engine.tiny.model import build_tiny_checkpoint


def perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    return model


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"reverse {w}"}], add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for w in ["ABC", "QWERT", "XYZW", "MNOPQR"]]
    backend = VllmRollout(str(model_dir), tokenizer, gpu_memory_utilization=0.3, sleep_level=0)
    core = backend._llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    result = {"block_size": core.vllm_config.cache_config.block_size,
              "prefix_caching": core.vllm_config.cache_config.enable_prefix_caching}
    from vllm import SamplingParams as VllmSamplingParams

    greedy = VllmSamplingParams(max_tokens=8, temperature=0.0, logprobs=0, detokenize=False)

    def continue_greedily(continued):
        outputs = backend._llm.generate([{"prompt_token_ids": c} for c in continued], greedy, use_tqdm=False)
        return ([o.num_cached_tokens for o in outputs],
                [[entry[t].logprob for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outputs])

    first = backend.generate(prompts, SamplingParams(max_new_tokens=40, temperature=1.0, seed=5))
    continued = [list(p) + g.response_ids for p, g in zip(prompts, first)]
    result["cached_blocks_before_load"] = len(pool.cached_block_hash_to_block)
    result["continued_prompt_tokens"] = [len(c) for c in continued]
    backend._model().load_weights(list(perturbed(model_dir, 1).state_dict().items()))
    result["kept_cached_tokens"], kept = continue_greedily(continued)  # the old weights' blocks still cached
    backend._forget_old_activations()
    result["dropped_cached_tokens"], dropped = continue_greedily(continued)
    result["max_abs_logprob_diff_kept_vs_dropped"] = max(abs(a - b) for x, y in zip(kept, dropped) for a, b in zip(x, y))
    result["same_tokens"] = [len(x) == len(y) for x, y in zip(kept, dropped)]
    print(json.dumps(result), flush=True)
    (out / "prefix_cache_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
