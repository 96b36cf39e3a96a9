"""The tiny MoE policy (Qwen3-MoE, 8 experts, top-2) learning the bundled task in-process, with a
routing replay mode: held-out greedy accuracy before and after, batch rewards, router metrics, wall
time. Prints one JSON object.

Usage: python bench/moe_learning.py MODEL_DIR DATA_DIR OUT_DIR [--replay r3] [--steps 50] [--lr 3e-4]
(MODEL_DIR and DATA_DIR from `trellis tiny-model MODEL_DIR --moe --data DATA_DIR`.)
"""

from __future__ import annotations

import argparse
import json
import time

from trellis.engine.config.loading import load_config
from trellis.engine.run.local import LocalRun

ROUTER = ("router/agreement", "router/replayed_tokens", "router/fallback_sequences", "router/load_entropy", "router/load_max_share")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--replay", default="r3", choices=["none", "r2", "r3"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    config = load_config(
        "configs/tiny_reverse.yaml", load_from=args.model, work_dir=args.out,
        train_dataset={"path": f"{args.data}/train.parquet", "max_prompt_length": 64},
        eval_dataset={"path": f"{args.data}/eval.parquet", "max_prompt_length": 64},
        experiment_name=f"moe_{args.replay}_{args.steps}_{args.lr:g}", total_train_steps=args.steps, evaluate_step=25,
        auto_resume=False, checkpoint_interval=-1, hf_interval=-1, exp_tracker="jsonl", optim={"lr": args.lr, "max_grad_norm": 1.0},
        rollout={"temperature": 0.6, "max_new_tokens": 8, "return_routed_experts": True},
        train_worker={"routing_replay": args.replay},
    )
    start = time.perf_counter()
    with LocalRun(config) as run:
        reports = run.run()
    wall = time.perf_counter() - start
    rewards = [r.metrics["response/rewards/mean"] for r in reports[1:]]
    print(json.dumps({
        "replay": args.replay, "steps": args.steps, "lr": args.lr, "wall_s": round(wall, 1),
        "eval_accuracy": {r.step: r.metrics["eval/accuracy"] for r in reports if "eval/accuracy" in r.metrics},
        "rewards_first5_last5": [sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5],
        "router_last_step": {k: reports[-1].metrics[k] for k in ROUTER if k in reports[-1].metrics},
        "step_s_median": sorted(r.metrics["time/step"] for r in reports[1:])[len(reports) // 2 - 1],
    }))


if __name__ == "__main__":
    main()
