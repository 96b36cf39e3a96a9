"""What ``train_worker.compile: auto`` costs on its first step and after how many steps it has paid for
itself: the trainer alone (``TrainingWorker.fit`` on one GPU, the random Qwen2-0.5B shape), each run in
a fresh process, on GRPO-shaped batches the size of trl_peer.py's step (256 samples: groups of 8 sharing
a 128-token prompt, responses of 64-256 tokens, a new batch every step, so the lengths vary as a run's
do). Three runs per round, alternated over ``--rounds``:

- ``eager``: ``compile: false``;
- ``cold``: ``compile: auto`` on empty inductor and Triton caches, as a first run on a machine;
- ``warm``: ``compile: auto`` again on the caches the cold run of the round left, as every later run
  (or resume) on that machine.

Per run: the seconds to build the worker (model load included), each step's ``fit``; reported: the
first step, the steady step (median of the steps after the second), the first step's extra time over
eager's first step, and the break-even step count = that extra over the steady gain per step.

    python bench/gpu/compile_cost.py OUT_DIR [--steps 8] [--rounds 2] [--smoke]

writes OUT_DIR/h200_compile_cost.json (``--smoke``, a check of the bench on CPU, where auto stays eager:
cpu_smoke_compile_cost.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for _compare

from _compare import spread, with_spread  # noqa: E402

WORK = Path("/tmp/trellis-gpu")
RUNS = ("eager", "cold", "warm")


def grpo_batches(steps: int, vocab: int, prompts: int):
    import random

    from train_mfu import grpo_group

    from trellis.engine.data.prepare import PreparedBatch

    rng = random.Random(0)
    for _ in range(steps):
        yield PreparedBatch(sequences=[seq for _ in range(prompts) for seq in grpo_group(rng, vocab, 8, (64, 256))])


def child(mode: str, steps: int, smoke: bool) -> dict:
    """One run in this process: build the worker, then ``steps`` fits, each timed to the GPU's end."""
    import torch
    from engine_steps import random_qwen2_05b

    from trellis.engine.config.loading import load_config
    from trellis.engine.tiny.model import build_tiny_checkpoint, build_tokenizer
    from trellis.engine.tiny.reverse_task import write_dataset
    from trellis.engine.train.worker import TrainingWorker

    if os.environ.get("TORCH_LOGS"):  # engine_steps silences logging below errors; TORCH_LOGS=recompiles asks for it
        logging.disable(logging.NOTSET)
    model_dir = WORK / ("tiny" if smoke else "qwen2-05b-random")
    if not (model_dir / "config.json").exists():
        build_tiny_checkpoint(model_dir) if smoke else random_qwen2_05b(build_tokenizer(), model_dir)
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    config = load_config(
        None, load_from=str(model_dir), train_dataset={"path": str(write_dataset(WORK / "cost.parquet", 64, seed=0))},
        reward={"function": "trellis.engine.tiny.reverse_task:score"}, total_train_steps=100,
        train_worker={"pack_max_length": 8192, "compile": False if mode == "eager" else "auto"},
    )
    started = time.perf_counter()
    worker = TrainingWorker(config, total_train_steps=100, pad_token_id=0)
    build_s = time.perf_counter() - started
    fits, compiles = [], []
    for step, batch in enumerate(grpo_batches(steps, worker.model.config.vocab_size, 2 if smoke else 32), 1):
        synchronize()
        started = time.perf_counter()
        worker.fit(batch, step)
        synchronize()
        fits.append(time.perf_counter() - started)
        compiles.append(compile_counts())
    return {"mode": mode, "compiled": worker.compiled, "build_s": build_s, "fit_s": fits, "compile_counts": compiles}


def compile_counts() -> dict[str, int]:
    """torch's compile counters so far (dynamo frames and graphs, AOT autograd and inductor cache hits and
    misses): a step whose counts grew compiled something, and TORCH_LOGS=recompiles says why."""
    from torch._dynamo.utils import counters

    return {f"{group}.{name}": count for group in ("frames", "stats", "aot_autograd", "inductor")
            for name, count in counters[group].items()}


def run(mode: str, args: argparse.Namespace, caches: Path, log: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    started = time.perf_counter()
    with open(log, "a") as out:
        subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps), str(args.out)]
                       + (["--smoke"] if args.smoke else []), check=True, stdout=out, stderr=subprocess.STDOUT, env=env)
    result = next(json.loads(line) for line in reversed(log.read_text().splitlines()) if line.startswith('{"mode"'))
    return {**result, "process_s": time.perf_counter() - started}


def summarize(runs: list[dict]) -> dict:
    eager = [r for r in runs if r["mode"] == "eager"]
    eager_first = statistics.median(r["fit_s"][0] for r in eager)
    eager_steady = statistics.median(f for r in eager for f in r["fit_s"][2:])
    summary = {}
    for mode in RUNS:
        of_mode = [r for r in runs if r["mode"] == mode]
        first = [r["fit_s"][0] for r in of_mode]
        steady = [f for r in of_mode for f in r["fit_s"][2:]]
        summary[mode] = {"build_s": spread(r["build_s"] for r in of_mode), "first_fit_s": spread(first),
                         "second_fit_s": spread(r["fit_s"][1] for r in of_mode), "steady_fit_s": spread(steady),
                         "process_s": spread(r["process_s"] for r in of_mode)}
        if mode != "eager":
            extra = statistics.median(first) - eager_first
            gain = eager_steady - statistics.median(steady)
            summary[mode] |= {"first_fit_extra_over_eager_s": extra, "steady_gain_per_step_s": gain,
                              "break_even_steps": extra / gain if gain > 0 else None,
                              "steady_speedup": eager_steady / statistics.median(steady)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="CPU: the tiny model, 2 x 8 samples a step")
    parser.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.smoke)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_ in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory(prefix="compile-caches-") as caches:  # empty: this round's cold run is cold
            order = RUNS if round_ % 2 else ("cold", "warm", "eager")
            for mode in order:
                result = {**run(mode, args, Path(caches), args.out / f"{mode}_{round_}.log"), "round": round_}
                runs.append(result)
                print(f"round {round_} {mode:5s} build {result['build_s']:.1f} s, fits {with_spread(result['fit_s'], '.2f')}, "
                      f"first {result['fit_s'][0]:.2f} s", flush=True)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report = {"device": device, "torch": torch.__version__, "steps": args.steps, "rounds": args.rounds,
              "runs": runs, "summary": summarize(runs)}
    (args.out / ("cpu_smoke_compile_cost.json" if args.smoke else "h200_compile_cost.json")).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
