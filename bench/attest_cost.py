"""What attesting every weight sync costs a step, on the bundled tiny model and task (CPU, in process).

Usage: python bench/attest_cost.py MODEL_DIR TRAIN_PARQUET OUT_JSON [--rounds 3] [--warmup 2] [--steps 6]

Two figures, each over alternated rounds (attestation on, then off, the order swapped every round; a
fresh run each, its first ``--warmup`` steps not measured):
- the component: each measured step's ``time/attest`` over its ``time/step`` (attestation on);
- end to end: the median step wall time with attestation on over the one with it off, per round.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
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
    args = parser.parse_args()
    rounds = []
    for index in range(args.rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
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
               "workload": f"tiny_reverse, {args.warmup} warm-up + {args.steps} measured steps per run, {args.rounds} alternated rounds"}
    with open(args.out, "w") as handle:
        json.dump(summary, handle, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
