"""Where vLLM's rollout time goes in trellis's setting, on one GPU: the engine in the caller's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what trellis runs so that weights reach it as tensor references)
against vLLM's default engine-core process, and, on each, the request options trellis sends (a seed per
request, the sampled token's logprob) against requests without one or both (TRL's colocated mode asks
for the logprob without a seed: ``no_seed``), and vLLM's flat logprobs container.

Random-init Qwen2-0.5B shape, 256 prompts of 128 random tokens, 256 new tokens (``ignore_eos``), T=1;
the engine built as trellis builds it (sleep mode, processed logprobs, no tokenizer). Each engine runs in
a child process of its own, by default in the order in-process, multiprocess, multiprocess, in-process;
inside a child the request variants (``VARIANTS``) alternate (order reversed every other round), fresh
prompts every call. ``nocache_K`` engines run in-process with prefix caching off (vLLM hashes every full
block of 16 tokens of every request, generated ones included, for its prefix cache); ``block32_K`` engines
run in-process with KV blocks of 32 tokens (half the blocks to allocate and hash); ``--group 8`` sends
each prompt 8 times in a row as GRPO does, so that the cache has something to save.
GPU busy is NVML's utilization sampled every 20 ms during each call.

    python bench/gpu/vllm_engine_modes.py OUT_DIR [--rounds 3] [--labels inproc_1,nocache_1,nocache_2,inproc_2]
        [--variants no_logprobs,trellis] [--group 8]                (writes OUT_DIR/engine_modes.json)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

NEW, PROMPT, BATCH = 256, 128, 256
MODEL = Path("/tmp/trellis-gpu/qwen2-05b-random-vocab")
VARIANTS = {  # name: (a seed per request, logprobs=0, vLLM's flat logprobs container)
    "trellis": (True, True, False),
    "flat_logprobs": (True, True, True),
    "no_seed": (False, True, False),
    "no_logprobs": (True, False, False),
    "neither": (False, False, False),
}


def prompts(seed: int, group: int = 1) -> list[list[int]]:
    """``BATCH`` prompts: ``BATCH // group`` random ones, each ``group`` times in a row as GRPO sends them."""
    rng = random.Random(seed)
    distinct = [[rng.randrange(3, 150_000) for _ in range(PROMPT)] for _ in range(BATCH // group)]
    return [prompt for prompt in distinct for _ in range(group)]


class GpuBusy:
    """NVML utilization, sampled on a thread while a call runs."""

    def __init__(self) -> None:
        import torch

        self._torch, self._samples, self._stop = torch, [], threading.Event()

    def __enter__(self):
        def sample() -> None:
            while not self._stop.wait(0.02):
                try:
                    self._samples.append(self._torch.cuda.utilization())
                except Exception:  # no NVML here: the figure is left out
                    return

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float | None:
        return statistics.mean(self._samples) if self._samples else None


def child(out: Path, label: str, rounds: int, variants: list[str], group: int) -> None:
    import torch
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    block = {"block_size": 32} if label.startswith("block32") else {}
    llm = LLM(model=str(MODEL), skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.3,
              max_model_len=PROMPT + NEW, enable_sleep_mode=True, seed=0, logprobs_mode="processed_logprobs",
              enable_prefix_caching=not label.startswith("nocache"), **block)
    start_s = time.perf_counter() - started
    config = llm.llm_engine.vllm_config
    facts = {
        "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
        "async_scheduling": config.scheduler_config.async_scheduling,
        "v2_model_runner": getattr(config, "use_v2_model_runner", None),
        "engine_start_s": start_s,
        "prefix_caching": config.cache_config.enable_prefix_caching,
        "block_size": config.cache_config.block_size,
        "prompts x repeats": f"{BATCH // group} x {group}",
    }

    def run(name: str, batch: list[list[int]]) -> tuple[int, float, float | None]:
        seeded, logprobs, flat = VARIANTS[name]
        params = [SamplingParams(max_tokens=NEW, temperature=1.0, ignore_eos=True, detokenize=False, flat_logprobs=flat,
                                 seed=(i + 1) if seeded else None, logprobs=0 if logprobs else None) for i in range(len(batch))]
        torch.cuda.synchronize()
        with GpuBusy() as busy:
            t0 = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outputs), elapsed, busy.mean

    for name in variants:  # warm-up
        run(name, prompts(hash(name) % 1000)[:32])
    results: dict[str, list[dict]] = {name: [] for name in variants}
    seed = 10_000 * (1 + int(label.rsplit("_", 1)[-1]))
    for round_index in range(rounds):
        for name in variants if round_index % 2 == 0 else reversed(variants):
            seed += 1  # fresh prompts: a repeated prompt would be served from the prefix cache
            tokens, elapsed, busy = run(name, prompts(seed, group))
            results[name].append({"tokens": tokens, "s": elapsed, "tok_s": tokens / elapsed, "gpu_busy_pct": busy})
    (out / f"{label}.json").write_text(json.dumps({"facts": facts, "runs": results}, indent=1))
    print(label, json.dumps(facts), {n: round(statistics.median(r["tok_s"] for r in v)) for n, v in results.items()}, flush=True)


def summarize(out: Path, labels: list[str]) -> dict:
    by_mode: dict[str, dict[str, list[float]]] = {}
    busy: dict[str, dict[str, list[float]]] = {}
    facts = {}
    for label in labels:
        data = json.loads((out / f"{label}.json").read_text())
        mode = label.rsplit("_", 1)[0]
        facts[label] = data["facts"]
        for name, runs in data["runs"].items():
            by_mode.setdefault(mode, {}).setdefault(name, []).extend(r["tok_s"] for r in runs)
            busy.setdefault(mode, {}).setdefault(name, []).extend(r["gpu_busy_pct"] for r in runs if r["gpu_busy_pct"] is not None)

    def stats(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)} if values else {}

    table = {mode: {name: {"tok_s": stats(v), "gpu_busy_pct": stats(busy[mode][name])} for name, v in names.items()}
             for mode, names in by_mode.items()}
    med = {mode: {name: statistics.median(v) for name, v in names.items()} for mode, names in by_mode.items()}
    ratios = {
        f"{mode}: {name} / trellis": med[mode][name] / med[mode]["trellis"]
        for mode in med for name in med[mode] if name != "trellis" and "trellis" in med[mode]
    }
    for other in ("mp", "nocache", "block32"):
        if {"inproc", other} <= med.keys():
            ratios |= {f"{other} / inproc, {name}": med[other][name] / med["inproc"][name] for name in med["inproc"]}
    return {"workload": f"random Qwen2-0.5B shape, {BATCH} x {PROMPT} prompt tokens, {NEW} new (ignore_eos), T=1",
            "facts": facts, "table": table, "ratios_of_medians": ratios}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", default=None)
    parser.add_argument("--labels", default="inproc_1,mp_1,mp_2,inproc_2",
                        help="the engines to start, in order: inproc_K, mp_K (vLLM's engine-core process), nocache_K "
                             "(in-process, prefix caching off), block32_K (in-process, 32-token KV blocks)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the request variants each engine runs")
    parser.add_argument("--group", type=int, default=1, help="each prompt this many times in a row (GRPO's samples per prompt)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.out, args.child, args.rounds, args.variants.split(","), args.group)
        os._exit(0)  # vLLM's engine threads would hold the process open; the parent ends its engine core
    if not (MODEL / "config.json").exists():
        subprocess.run([sys.executable, ".gpu/tools/make_random_model.py", str(MODEL), "0"], check=True)
    labels = args.labels.split(",")
    for label in labels:
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if label.startswith("mp") else "0")
        with open(args.out / f"{label}.log", "w") as log:
            proc = subprocess.Popen([sys.executable, __file__, str(args.out), "--rounds", str(args.rounds), "--child", label,
                                     "--variants", args.variants, "--group", str(args.group)],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=240)
            finally:  # the multiprocess engine's core outlives its parent: end the whole session
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        time.sleep(3)  # the GPU memory of the ended engine comes back
    done = [label for label in labels if (args.out / f"{label}.json").exists()]
    summary = summarize(args.out, done)
    (args.out / "engine_modes.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
