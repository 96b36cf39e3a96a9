"""One vLLM engine per GPU against two, each with half the batch, for a small policy whose rollout is
host-bound.

The flow's rollout (0.5B, 256 x 256 new tokens) spends 99% of its time in the one thread that steps the
engine, on the CPU (``flow_steps.py --probe-rollout``), with the GPU busy 22-47% of it. Two engines in
two processes step on two cores at once, sharing the GPU. This measures what that gains with trellis's
own backend (``VllmRollout``, the logprob tap on), before anything is built on it.

Three child processes hold an engine each, built one after another: ``solo`` (``--memory`` of the GPU,
the whole batch) and ``pair_a`` / ``pair_b`` (half the memory and half the batch each). Every round runs
the whole batch on ``solo`` and on the pair (both started together, timed first start to last end), the
order reversed every other round, fresh prompts each round. Random-init Qwen2-0.5B shape, 128 prompt
tokens, ``--new`` new tokens, T=1, a seed per request, as trellis asks.

    python bench/gpu/vllm_engines_per_gpu.py OUT_DIR [--rounds 6] [--batch 256] [--new 256] [--memory 0.3]
                                                                        (writes OUT_DIR/engines_per_gpu.json)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for _compare

from _compare import spread  # noqa: E402

MODEL = Path("/tmp/trellis-gpu/qwen2-05b-random")
PROMPT = 128


def child(memory: float) -> None:
    """An engine that answers ``<seed> <count> <new>`` lines on stdin with a JSON line of its timing."""
    from trellis.engine.rollout.backends.base import SamplingParams
    from trellis.engine.rollout.backends.vllm_backend import VllmRollout
    from trellis.engine.tiny.model import build_tokenizer

    backend = VllmRollout(str(MODEL), build_tokenizer(), gpu_memory_utilization=memory)
    print("READY", flush=True)
    for line in sys.stdin:
        seed, count, new = map(int, line.split())
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, 1000) for _ in range(PROMPT)] for _ in range(count)]
        started = time.time()
        tokens = sum(len(g.response_ids) for _, g in backend.stream(prompts, SamplingParams(max_new_tokens=new, seed=seed)))
        print("RESULT " + json.dumps({"started": started, "ended": time.time(), "tokens": tokens}), flush=True)
    os._exit(0)


class Engine:
    def __init__(self, name: str, memory: float, log: Path) -> None:
        from engine_steps import vllm_child_env

        env = vllm_child_env()
        self.name = name
        self._process = subprocess.Popen([sys.executable, __file__, "--child", str(memory)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)
        self._read("READY")

    def _read(self, prefix: str) -> str:
        for line in self._process.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"engine {self.name} ended before {prefix!r}: see its log")

    def ask(self, seed: int, count: int, new: int) -> None:
        self._process.stdin.write(f"{seed} {count} {new}\n")
        self._process.stdin.flush()

    def answer(self) -> dict:
        return json.loads(self._read("RESULT "))

    def close(self) -> None:
        self._process.kill()


def run_side(engines: list[Engine], seed: int, batch: int, new: int) -> dict:
    for index, engine in enumerate(engines):
        engine.ask(seed + index, batch // len(engines), new)
    answers = [engine.answer() for engine in engines]
    wall = max(a["ended"] for a in answers) - min(a["started"] for a in answers)
    tokens = sum(a["tokens"] for a in answers)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "engine_walls_s": [a["ended"] - a["started"] for a in answers]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--memory", type=float, default=0.3, help="the solo engine's gpu_memory_utilization")
    parser.add_argument("--child", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child)
    args.out.mkdir(parents=True, exist_ok=True)
    if not (MODEL / "config.json").exists():
        from engine_steps import random_qwen2_05b
        from trellis.engine.tiny.model import build_tokenizer

        random_qwen2_05b(build_tokenizer(), MODEL)
    sides = {"solo": [Engine("solo", args.memory, args.out / "solo.log")],
             "pair": [Engine(name, args.memory / 2, args.out / f"{name}.log") for name in ("pair_a", "pair_b")]}
    for engines in sides.values():  # warm-up: each engine's first call compiles and allocates
        run_side(engines, 0, args.batch, args.new)
    rounds = []
    for number in range(args.rounds):
        order = ("solo", "pair") if number % 2 == 0 else ("pair", "solo")
        measured = {side: run_side(sides[side], 1000 * (number + 1), args.batch, args.new) for side in order}
        measured["pair_over_solo"] = measured["pair"]["tokens_per_s"] / measured["solo"]["tokens_per_s"]
        rounds.append({"order": order, **measured})
        print(f"round {number + 1} {order}: solo {measured['solo']['tokens_per_s']:.0f} tok/s, "
              f"pair {measured['pair']['tokens_per_s']:.0f} tok/s, pair/solo {measured['pair_over_solo']:.3f}", flush=True)
    for engines in sides.values():
        for engine in engines:
            engine.close()
    ratios = [r["pair_over_solo"] for r in rounds]
    summary = {
        "batch": args.batch, "new_tokens": args.new, "prompt_tokens": PROMPT, "solo_memory": args.memory,
        "solo_tokens_per_s": spread([r["solo"]["tokens_per_s"] for r in rounds]),
        "pair_tokens_per_s": spread([r["pair"]["tokens_per_s"] for r in rounds]),
        "pair_over_solo": spread(ratios),
        "rounds": rounds,
    }
    (args.out / "engines_per_gpu.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=1), flush=True)


if __name__ == "__main__":
    main()
