"""LoRA against full fine-tuning on the bundled task, in-process on CPU: held-out greedy accuracy at the
start, middle and end, wall time and step time, one JSON line per run and a summary.

The sides differ only in ``lora`` and the learning rate (adapters start at zero effect, so LoRA is
usually run at several times the full fine-tune's rate). Rounds alternate the sides, each round with
its own seed (prompt order, sampling, adapter init), so a slow minute of the machine falls on both.

Usage: python bench/lora_learning.py MODEL_DIR DATA_DIR OUT_DIR [--steps 50] [--rounds 2]
       [--side full:3e-4 --side lora8:3e-3 ...]
(MODEL_DIR and DATA_DIR from `trellis tiny-model MODEL_DIR --data DATA_DIR`.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from trellis.engine.config.loading import load_config
from trellis.engine.run.local import LocalRun

DEFAULT_SIDES = ("full:3e-4", "lora8:3e-4", "lora8:3e-3", "lora32:3e-3")


def run_side(side: str, args: argparse.Namespace, seed: int) -> dict:
    """``side`` is ``full:LR`` or ``lora{RANK}:LR`` (alpha = 2 x rank, every linear layer of the blocks)."""
    kind, lr = side.split(":")
    lora = None if kind == "full" else {"rank": int(kind.removeprefix("lora")), "alpha": 2 * int(kind.removeprefix("lora"))}
    config = load_config(
        "configs/tiny_reverse.yaml", load_from=args.model, work_dir=args.out,
        train_dataset={"path": f"{args.data}/train.parquet", "max_prompt_length": 64},
        eval_dataset={"path": f"{args.data}/eval.parquet", "max_prompt_length": 64},
        experiment_name=f"{kind}_{lr}_seed{seed}", total_train_steps=args.steps, evaluate_step=args.steps // 2, seed=seed,
        auto_resume=False, checkpoint_interval=-1, hf_interval=-1, exp_tracker="jsonl", optim={"lr": float(lr), "max_grad_norm": 1.0},
        lora=lora,
    )
    start = time.perf_counter()
    with LocalRun(config, track=False) as run:
        reports = run.run()
    wall = time.perf_counter() - start
    steps = sorted(r.metrics["time/step"] for r in reports[1:])
    return {
        "side": side, "seed": seed, "wall_s": round(wall, 1), "step_s_median": round(statistics.median(steps), 3),
        "eval_accuracy": {r.step: round(r.metrics["eval/accuracy"], 3) for r in reports if "eval/accuracy" in r.metrics},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--side", action="append", help=f"repeatable; default {' '.join(DEFAULT_SIDES)}")
    args = parser.parse_args()
    sides = args.side or list(DEFAULT_SIDES)
    runs = []
    for round_index in range(args.rounds):
        order = sides if round_index % 2 == 0 else sides[::-1]
        for side in order:
            runs.append(run_side(side, args, seed=42 + round_index))
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for side in sides:
        mine = [run for run in runs if run["side"] == side]
        finals = [run["eval_accuracy"][args.steps] for run in mine]
        summary[side] = {
            "final_accuracy": finals, "start_accuracy": [run["eval_accuracy"][0] for run in mine],
            "step_s_median": statistics.median(run["step_s_median"] for run in mine),
            "step_s_range": [min(run["step_s_median"] for run in mine), max(run["step_s_median"] for run in mine)],
        }
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
