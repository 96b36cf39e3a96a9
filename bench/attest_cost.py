"""What attesting every weight sync costs a step, on the bundled tiny model and task (CPU, in process).

Usage: python bench/attest_cost.py MODEL_DIR TRAIN_PARQUET OUT_JSON [--rounds 3] [--warmup 2] [--steps 6] [--flow]

Over alternated rounds (attestation on, then off, the order swapped every round; a fresh run each, its
first ``--warmup`` steps not measured):
- end to end: the median step wall time with attestation on over the one with it off, per round;
- the component: each measured step's ``time/attest`` over its ``time/step`` (the comparison of the
  evidence; the checksums taken while sending and receiving count in ``sync_weights``, not here).
In process by default (``LocalRun``); ``--flow``: the user's main job, Prefect flow runs driving Ray
actors (``bench/trellis_flow_step.py``, which warms up 3 steps; ``--warmup`` is ignored there).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

from _measure import StepClock  # noqa: E402

from trellis.engine.config.loading import load_config  # noqa: E402
from trellis.engine.run.local import LocalRun  # noqa: E402


def one_run(model_dir: str, train_path: str, attest: bool, warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            "configs/tiny_reverse.yaml", load_from=model_dir, train_dataset={"path": train_path},
            total_train_steps=warmup + steps, checkpoint_interval=-1, enable_evaluate=False, work_dir=tmp,
            attest={"enabled": attest},
        )
        clock, shares = StepClock(), []
        with LocalRun(config, track=False) as run:
            for step in range(1, warmup + steps + 1):
                clock.start()
                metrics = run.train_step().metrics
                clock.stop()
                if step > warmup and attest:
                    shares.append(metrics["time/attest"] / metrics["time/step"])
        return {"wall": clock.wall[warmup:], "attest_share": shares}


def one_flow_run(model_dir: str, train_path: str, attest: bool, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/flow.json"
        flag = ["attest" if attest else "no-attest"]
        subprocess.run([sys.executable, "bench/trellis_flow_step.py", model_dir, train_path, str(steps), out, *flag], check=True)
        with open(out) as handle:
            measured = json.load(handle)
    wall = measured["wall"]
    shares = [phases.get("time/attest", 0.0) / step_s for phases, step_s in zip(measured["phases"], wall)] if attest else []
    return {"wall": wall, "attest_share": shares}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("train_path")
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--flow", action="store_true")
    args = parser.parse_args()
    rounds = []
    for index in range(args.rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        if args.flow:
            runs = {on: one_flow_run(args.model_dir, args.train_path, on, args.steps) for on in order}
        else:
            runs = {on: one_run(args.model_dir, args.train_path, on, args.warmup, args.steps) for on in order}
        rounds.append({
            "order": ["on" if on else "off" for on in order],
            "step_s_on": statistics.median(runs[True]["wall"]),
            "step_s_off": statistics.median(runs[False]["wall"]),
            "attest_share": runs[True]["attest_share"],
        })
        print(json.dumps(rounds[-1]), file=sys.stderr)
    shares = [share for r in rounds for share in r["attest_share"]]
    ratios = [r["step_s_on"] / r["step_s_off"] for r in rounds]
    summary = {"attest_share_of_step": spread(shares), "step_time_on_over_off": spread(ratios), "rounds": rounds,
               "runner": "flow" if args.flow else "in-process",
               "workload": f"tiny_reverse, {3 if args.flow else args.warmup} warm-up + {args.steps} measured steps per run, "
                           f"{args.rounds} alternated rounds"}
    with open(args.out, "w") as handle:
        json.dump(summary, handle, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
