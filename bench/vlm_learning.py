"""The tiny vision-language policy learning the shapes task in-process (configs/tiny_shapes.yaml), over
several seeds: held-out greedy accuracy before, at each evaluation and after, the batch rewards of the
first and last 20 steps, and wall time. Prints one JSON object and writes it to OUT_DIR.

Usage: python bench/vlm_learning.py MODEL_DIR DATA_DIR OUT_DIR [--seeds 1,2,3] [--steps 120] [--unfrozen]
(MODEL_DIR and DATA_DIR from `trellis tiny-model MODEL_DIR --vlm --data DATA_DIR`.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from trellis.engine.config.loading import load_config
from trellis.engine.run.local import LocalRun


def one_run(args: argparse.Namespace, seed: int) -> dict:
    config = load_config(
        "configs/tiny_shapes.yaml", load_from=args.model, work_dir=args.out,
        train_dataset={"path": f"{args.data}/train.parquet", "max_prompt_length": 64},
        eval_dataset={"path": f"{args.data}/eval.parquet", "max_prompt_length": 64, "limit": 256},
        experiment_name=f"vlm_seed{seed}_{args.steps}{'_unfrozen' if args.unfrozen else ''}", seed=seed,
        total_train_steps=args.steps, auto_resume=False, checkpoint_interval=-1, hf_interval=-1, exp_tracker="jsonl",
        train_worker={"freeze_vision": not args.unfrozen},
    )
    start = time.perf_counter()
    with LocalRun(config) as run:
        run.run()
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (Path(config.run_uri) / "logs" / "metrics.jsonl").read_text().splitlines()]
    accuracy = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    rewards = [r["response/rewards/mean"] for r in records if "response/rewards/mean" in r]
    return {
        "seed": seed,
        "eval_accuracy": accuracy,
        "gain": accuracy[max(accuracy)] - accuracy[0],
        "reward_first_20": statistics.mean(rewards[:20]),
        "reward_last_20": statistics.mean(rewards[-20:]),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--unfrozen", action="store_true", help="train the vision tower too (train_worker.freeze_vision: false)")
    args = parser.parse_args()
    runs = [one_run(args, int(seed)) for seed in args.seeds.split(",")]
    gains = [run["gain"] for run in runs]
    summary = {"steps": args.steps, "freeze_vision": not args.unfrozen, "gain_mean": statistics.mean(gains),
               "gain_min": min(gains), "gain_max": max(gains), "runs": runs}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"vlm_learning{'_unfrozen' if args.unfrozen else ''}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
