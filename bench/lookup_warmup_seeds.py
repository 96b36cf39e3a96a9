"""How far RL takes the bundled lookup task from warm-ups of other seeds: each seed's data stream lands
the warm-up's jump in success at another step, as another CPU's arithmetic does, so the spread over
seeds is what machines can expect of ``configs/tiny_lookup.yaml``. Per seed: the warm-up's wall time,
then 30 in-process RL steps (``LocalRun``, the flow's phases) and held-out greedy success at steps 0,
10, 20 and 30. One JSON line per seed and a summary. torch's thread count changes the arithmetic too
(TRELLIS_TORCH_THREADS / OMP_NUM_THREADS; the tests run one thread).

Usage: python bench/lookup_warmup_seeds.py OUT_DIR [--seeds 8 3 5 11] [--lr 5e-4]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from trellis.engine.config.loading import load_config
from trellis.engine.run.local import LocalRun
from trellis.engine.tiny import lookup_task


def run_seed(seed: int, args: argparse.Namespace) -> dict:
    root = args.out / f"seed{seed}"
    data = root / "data"
    lookup_task.write_dataset(data / "train.parquet", 4096, seed=0)  # the prompts the tests use
    lookup_task.write_dataset(data / "eval.parquet", 512, seed=lookup_task.EVAL_SEED_OFFSET)
    start = time.perf_counter()
    model = lookup_task.build_checkpoint(root / "model", warmup_seed=seed)
    warmup_s = time.perf_counter() - start
    config = load_config(
        "configs/tiny_lookup.yaml", load_from=str(model), work_dir=str(root), experiment_name="rl",
        train_dataset={"path": str(data / "train.parquet"), "max_prompt_length": 64},
        eval_dataset={"path": str(data / "eval.parquet"), "max_prompt_length": 64, "limit": 256},
        checkpoint_interval=-1, auto_resume=False, optim={"lr": args.lr},
    )
    with LocalRun(config, track=False) as run:
        reports = run.run()
    return {
        "seed": seed, "lr": args.lr, "torch_threads": torch.get_num_threads(), "warmup_s": round(warmup_s, 1),
        "eval_accuracy": {r.step: round(r.metrics["eval/accuracy"], 3) for r in reports if "eval/accuracy" in r.metrics},
        "reward_first_5": round(sum(r.metrics["response/rewards/mean"] for r in reports[1:6]) / 5, 3),
        "reward_last_5": round(sum(r.metrics["response/rewards/mean"] for r in reports[-5:]) / 5, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[8, 3, 5, 11])
    parser.add_argument("--lr", type=float, default=5e-4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        results.append(run_seed(seed, args))
        print(json.dumps(results[-1]), flush=True)
    finals = sorted(r["eval_accuracy"][max(r["eval_accuracy"])] for r in results)
    print(json.dumps({"seeds": args.seeds, "lr": args.lr, "final_eval_min": finals[0], "final_eval_max": finals[-1],
                      "starts": [r["eval_accuracy"][0] for r in results]}))


if __name__ == "__main__":
    main()
