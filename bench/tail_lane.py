"""The tail lane (``replay_buffer.tail_batch_trigger_size`` N > 0) against regenerating expired groups at
once (0), on the asynchronous trainer with a long tail of response lengths, in-process on CPU.

Same untrained tiny model (it never stops by itself, so every response runs to its prompt's cap), same
prompts with lognormal caps (the dataset's ``max_new_tokens`` column), max_staleness 1 with partial
rollout, so a response that spans more than two weight syncs expires. Each side runs ``--steps`` steps, rounds
alternated (A B A B), each round with its own seed on both sides. Per run: expired groups, the tokens
they threw away, tail rounds and tail groups trained, trained tokens and steps' wall time; medians
with the spread over the rounds.

Usage: python bench/tail_lane.py OUT_DIR [--steps 16] [--rounds 2] [--trigger 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compare import run_sides  # noqa: E402

from trellis.engine.config.loading import load_config  # noqa: E402
from trellis.engine.run.local import LocalRun  # noqa: E402
from trellis.engine.tiny.model import build_tiny_checkpoint  # noqa: E402
from trellis.engine.tiny.reverse_task import write_dataset  # noqa: E402

FIGURES = ("expired_groups", "expired_tokens", "tail_rounds", "tail_trained_groups", "trained_tokens", "wall_s",
           "trained_tokens_per_s", "step_s_median")


def long_tail_prompts(path: Path, count: int, *, mean: float, cap: int) -> Path:
    write_dataset(path, count, seed=0)
    mu = np.log(mean) - 0.5
    caps = np.clip(np.random.default_rng(1).lognormal(mu, 1.0, count), 2, cap).astype(int).tolist()
    pq.write_table(pq.read_table(path).append_column("max_new_tokens", pa.array(caps, pa.int64())), path)
    return path


def long_tail_workspace(prefix: str, *, mean: float, cap: int) -> tuple[Path, Path, Path]:
    """A temporary folder with the untrained tiny model and 1,024 long-tail prompts: (folder, model, prompts)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    model = build_tiny_checkpoint(work / "model", warmup=False)
    return work, model, long_tail_prompts(work / "train.parquet", 1024, mean=mean, cap=cap)


def long_tail_config(work: Path, model: Path, data: Path, *, name: str, steps: int, cap: int, trigger: int,
                     max_staleness: int = 1, seed: int = 42):
    """The asynchronous trainer on the long-tail prompts: 8 prompts x 4, partial rollout, no evaluation or saves."""
    return load_config(
        "configs/tiny_reverse_async.yaml", load_from=str(model), train_dataset={"path": str(data), "max_prompt_length": 64},
        eval_dataset=None, enable_evaluate=False, enable_initial_evaluate=False, work_dir=str(work), experiment_name=name,
        total_train_steps=steps, train_batch_size=8, prompt_repeat_k=4, seed=seed, auto_resume=False,
        checkpoint_interval=-1, hf_interval=-1, exp_tracker="jsonl", rollout={"max_new_tokens": cap, "temperature": 1.0},
        replay_buffer={"kind": "async", "max_staleness": max_staleness, "enable_partial_rollout": True,
                       "tail_batch_trigger_size": trigger},
    )


def run_side(trigger: int, seed: int, model: Path, data: Path, work: Path, args: argparse.Namespace) -> dict:
    config = long_tail_config(work, model, data, name=f"tail{trigger}_seed{seed}", steps=args.steps, cap=args.cap,
                              trigger=trigger, max_staleness=args.max_staleness, seed=seed)
    started = time.perf_counter()
    with LocalRun(config) as local:
        local.run()
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in Path(config.run_uri, "logs", "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    trained = sum(r["response/training_tokens"] for r in rows)
    return {
        "trigger": trigger, "seed": seed, "expired_groups": last["async/expired_groups"],
        "expired_tokens": sum(r.get("async/discarded_tokens/expired", 0.0) for r in rows),
        "tail_rounds": last.get("async/tail_rounds", 0.0), "tail_trained_groups": last.get("async/tail_trained_groups", 0.0),
        "tail_waiting_at_end": last.get("async/tail_waiting_groups", 0.0),
        "trained_tokens": trained, "wall_s": wall, "trained_tokens_per_s": trained / wall,
        "step_s_median": float(np.median([r["time/step"] for r in rows])),
        "response_len_mean": float(np.mean([r["response/response_len/mean"] for r in rows])),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trigger", type=int, default=8, help="the tail lane's side (the other side is 0)")
    parser.add_argument("--cap", type=int, default=48, help="the longest response")
    parser.add_argument("--mean-len", type=float, default=10.0)
    parser.add_argument("--max-staleness", type=int, default=1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work, model, data = long_tail_workspace("trellis-tail-lane-", mean=args.mean_len, cap=args.cap)
    sides = {"regenerate at once (0)": 0, f"tail lane ({args.trigger})": args.trigger}
    summary = run_sides(sides, args.rounds, lambda trigger, round_: run_side(trigger, seed=round_, model=model, data=data,
                                                                           work=work, args=args), FIGURES)
    (args.out / "tail_lane.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
