"""Colocated over-sampling (``replay_buffer.over_sample_threshold``) against the plain colocated trainer, on
a long tail of response lengths, in process on CPU.

Same untrained tiny model (it never stops by itself, so every response runs to its prompt's cap), same
prompts with lognormal caps (the dataset's ``max_new_tokens`` column), same batch (8 prompts x 4), same
steps, rounds alternated (A B A B), each round with its own seed on both sides. The over-sampling side
launches 8 x (1 + threshold) groups a step, trains the first 8 to end and continues the rest next step
(partial rollout, ``--max-staleness``, optionally the tail lane). Per run: trained tokens per second over the whole run (what the user
waits on), step time (median and spread over the run's steps), the trained response length (over-sampling
trains the short responses first, so tokens/s, not steps/s, is the figure), expired groups and the tokens
they threw away, and the run's goodput.

Usage: python bench/colocated_over_sampling.py OUT_DIR [--steps 24] [--rounds 3] [--threshold 0.5] [--max-staleness 1]
    [--tail-trigger 0] [--mean-len 32] [--cap 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compare import run_sides  # noqa: E402
from tail_lane import long_tail_workspace  # noqa: E402

from trellis.engine.config.loading import load_config  # noqa: E402
from trellis.engine.run.local import LocalRun  # noqa: E402
from trellis.engine.storage.lake_query import run_goodput  # noqa: E402

FIGURES = ("trained_tokens_per_s", "wall_s", "step_s_median", "step_s_min", "step_s_max", "trained_tokens",
           "trained_response_len", "expired_groups", "expired_tokens", "goodput_percent")


def run_side(threshold: float, seed: int, model: Path, data: Path, work: Path, args: argparse.Namespace) -> dict:
    buffer = {"over_sample_threshold": threshold, "max_staleness": args.max_staleness, "enable_partial_rollout": True,
              "tail_batch_trigger_size": args.tail_trigger} if threshold else {}
    config = load_config(
        "configs/tiny_reverse.yaml", load_from=str(model), train_dataset={"path": str(data), "max_prompt_length": 64},
        eval_dataset=None, enable_evaluate=False, enable_initial_evaluate=False, work_dir=str(work),
        experiment_name=f"over{threshold:g}_seed{seed}", total_train_steps=args.steps, train_batch_size=8, prompt_repeat_k=4,
        seed=seed, auto_resume=False, checkpoint_interval=-1, hf_interval=-1, exp_tracker="jsonl",
        rollout={"max_new_tokens": args.cap, "temperature": 1.0}, replay_buffer=buffer,
    )
    started = time.perf_counter()
    with LocalRun(config) as local:
        local.run()
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in Path(config.run_uri, "logs", "metrics.jsonl").read_text().splitlines()]
    steps = [r["time/step"] for r in rows]
    trained = sum(r["response/trained_response_tokens"] for r in rows)  # response tokens: prompts are alike on both sides
    return {
        "threshold": threshold, "seed": seed, "trained_tokens": trained, "wall_s": wall, "trained_tokens_per_s": trained / wall,
        "step_s_median": float(np.median(steps)), "step_s_min": min(steps), "step_s_max": max(steps),
        "trained_response_len": float(np.mean([r["response/response_len/mean"] for r in rows])),
        "expired_groups": rows[-1].get("async/expired_groups", 0.0),
        "expired_tokens": sum(r.get("async/discarded_tokens/expired", 0.0) for r in rows),
        "goodput_percent": run_goodput({r["step"]: r for r in rows}),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.5, help="the over-sampling side's over_sample_threshold")
    parser.add_argument("--cap", type=int, default=256, help="the longest response")
    parser.add_argument("--mean-len", type=float, default=32.0)
    parser.add_argument("--max-staleness", type=int, default=1, help="the over-sampling side's token staleness bound")
    parser.add_argument("--tail-trigger", type=int, default=0, help="the over-sampling side's tail_batch_trigger_size")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work, model, data = long_tail_workspace("trellis-over-sampling-", mean=args.mean_len, cap=args.cap)
    sides = {"colocated": 0.0, f"colocated, over-sampling {args.threshold:g}": args.threshold}
    summary = run_sides(sides, args.rounds, lambda threshold, round_: run_side(threshold, seed=round_, model=model, data=data,
                                                                             work=work, args=args), FIGURES)
    runs = summary["runs"]
    plain, over = (runs[name] for name in sides)
    ratios = [o["trained_tokens_per_s"] / p["trained_tokens_per_s"] for p, o in zip(plain, over)]  # paired by round
    summary["tokens_per_s_ratio_by_round"] = ratios
    print("trained tokens/s, over-sampling / plain, by round: " + ", ".join(f"{r:.2f}x" for r in ratios))
    (args.out / "colocated_over_sampling.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
