"""Why the stepped vLLM loop lost 17-24% of its rollout speed, measured on one engine in one call:
trellis's ``stream`` (output only when a request ends, ``FINAL_ONLY``), the same step loop asking for
every running request's new tokens on every engine step (``DELTA``, as trellis did up to 45f530e), and
bare ``LLM.generate``. Random-init Qwen2-0.5B shape, 256 prompts of 128 tokens, 256 new tokens, T=1,
logprobs=0 on every side; 6 rounds, the order of the three sides reversed every other round.

    python bench/gpu/vllm_output_kind.py OUT_DIR     (writes OUT_DIR/ab_delta.json)
"""

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_steps import random_qwen2_05b  # noqa: E402

from trellis.engine.rollout.backends.base import SamplingParams  # noqa: E402
from trellis.engine.rollout.backends.vllm_backend import VllmRollout  # noqa: E402
from trellis.engine.tiny.model import build_tokenizer  # noqa: E402

NEW, ROUNDS = 256, 6


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(count)]


def vllm_params(index: int, **extra):
    from vllm import SamplingParams as VllmParams

    return VllmParams(max_tokens=NEW, temperature=1.0, seed=index + 1, logprobs=0, detokenize=False, **extra)


def delta_loop(backend: VllmRollout, batch: list[list[int]]) -> int:
    """The step loop with an output per running request per engine step, as before the fix."""
    from vllm.sampling_params import RequestOutputKind

    engine = backend._llm.llm_engine
    ids = [f"delta-{time.monotonic_ns()}-{i}" for i in range(len(batch))]
    for i, (request_id, prompt) in enumerate(zip(ids, batch)):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, vllm_params(i, output_kind=RequestOutputKind.DELTA))
    tokens = {request_id: [] for request_id in ids}
    logprobs = {request_id: [] for request_id in ids}
    left = set(ids)
    while left and engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            tokens[output.request_id] += completion.token_ids
            logprobs[output.request_id] += [e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs or [])]
            if output.finished:
                left.discard(output.request_id)
    return sum(len(t) for t in tokens.values())


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model_dir = random_qwen2_05b(tokenizer, Path("/tmp/trellis-gpu/qwen2-05b-random"))
    vocab = len(tokenizer)
    backend = VllmRollout(str(model_dir), tokenizer, gpu_memory_utilization=0.45, max_model_len=128 + NEW)
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=1)

    def bare(batch: list[list[int]]) -> int:
        requests = [{"prompt_token_ids": p} for p in batch]
        outputs = backend._llm.generate(requests, [vllm_params(i) for i in range(len(batch))], use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    sides = {
        "final_only": lambda batch: sum(len(g.response_ids) for g in backend.generate(batch, params)),
        "delta": lambda batch: delta_loop(backend, batch),
        "bare": bare,
    }
    for side in sides.values():  # warm-up
        side(prompts(16, vocab, 0))
    tok_s: dict[str, list[float]] = {name: [] for name in sides}
    seed = 1000
    for round_index in range(ROUNDS):
        for name in sides if round_index % 2 == 0 else reversed(list(sides)):
            seed += 1  # fresh prompts every call: a repeated prompt would be served from the prefix cache
            batch = prompts(256, vocab, seed)
            torch.cuda.synchronize()
            started = time.perf_counter()
            tokens = sides[name](batch)
            torch.cuda.synchronize()
            tok_s[name].append(tokens / (time.perf_counter() - started))
    result: dict = {name: {"median_tok_s": statistics.median(v), "min": min(v), "max": max(v), "all": v} for name, v in tok_s.items()}
    median = {name: statistics.median(v) for name, v in tok_s.items()}
    result |= {
        "final_only_vs_bare": median["final_only"] / median["bare"],
        "delta_vs_bare": median["delta"] / median["bare"],
        "final_only_vs_delta": median["final_only"] / median["delta"],
    }
    (out / "ab_delta.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads would hold the process open
