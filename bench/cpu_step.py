"""trellis's GRPO step against TRL's GRPOTrainer on the same model, task and settings.

Three contestants run alternately as child processes of this one (A B C A B C ...), so that machine
noise hits all alike: trellis's in-process engine, trellis's full orchestrated step (Prefect flow
runs driving Ray actors; bench/trellis_flow_step.py) and TRL. Prints median seconds and CPU-seconds
per step, the orchestration overhead per step, and as the last line
`ratio_vs_trl <trellis engine median / TRL median>` (goal: <= 0.7).

    python bench/cpu_step.py [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _compare import spread, with_spread

HERE = Path(__file__).resolve().parent
WARMUP_STEPS = 3  # first steps pay for lazy init (worker spawn, allocator): not a steady-state step


def run(script: str, model: Path, data: Path, steps: int, out: Path, env: dict[str, str]) -> dict:
    subprocess.run([sys.executable, str(HERE / script), str(model), str(data), str(steps), str(out)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=HERE, env={**os.environ, **env})
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    from trellis.engine.tiny.model import build_tiny_checkpoint
    from trellis.engine.tiny.reverse_task import write_dataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_checkpoint(root / "tiny")
        data = write_dataset(root / "train.parquet", 4096, seed=0)
        # flow-prefect-defaults: the flow step on a temporary Prefect server with Prefect's own settings,
        # for what flows.prefect_settings saves; flow-health-check: with the check_rollout task every step.
        contestants = (
            ("trellis", "trellis_step.py", WARMUP_STEPS, {}),
            ("trellis-flow", "trellis_flow_step.py", 0, {}),
            ("flow-prefect-defaults", "trellis_flow_step.py", 0, {"TRELLIS_BENCH_PREFECT_DEFAULTS": "1"}),
            ("flow-health-check", "trellis_flow_step.py", 0, {"TRELLIS_BENCH_HEALTH_CHECK": "1"}),
            ("trl", "trl_peer.py", WARMUP_STEPS, {}),
        )
        results = {name: {"wall": [], "cpu": [], "rss": [], "overhead": [], "round_medians": []} for name, _, _, _ in contestants}
        for round_index in range(args.rounds):
            for name, script, skip, env in contestants:
                figures = run(script, model, data, args.steps, root / f"{name}-{round_index}.json", env)
                results[name]["wall"] += figures["wall"][skip:]
                results[name]["cpu"] += figures["cpu"][skip:]
                results[name]["overhead"] += figures.get("overhead", [])
                results[name]["rss"].append(figures["peak_rss_gb"])
                results[name]["round_medians"].append(statistics.median(figures["wall"][skip:]))
                print(f"round {round_index + 1} {name:21s} median {with_spread(figures['wall'][skip:])} s/step", flush=True)

    medians = {name: statistics.median(r["wall"]) for name, r in results.items()}
    for name, r in results.items():
        print(f"{name:21s} median {with_spread(r['wall'])} s/step   CPU {with_spread(r['cpu'])} CPU-s/step   "
              f"RSS {max(r['rss']):.2f} GB (driver process)")
    for name in ("trellis-flow", "flow-prefect-defaults", "flow-health-check"):
        print(f"{name}: orchestration overhead (workers idle, from Ray's timeline) {with_spread(results[name]['overhead'])} s/step")

    def ratio(a: str, b: str, label: str) -> None:
        """The ratio of the pooled medians, and beside it the spread of the rounds' own ratios."""
        rounds = spread(x / y for x, y in zip(results[a]["round_medians"], results[b]["round_medians"]))
        print(f"{label} {medians[a] / medians[b]:.3f}   (per round: {rounds['min']:.3f} .. {rounds['max']:.3f}, n={rounds['n']})")

    ratio("trellis-flow", "flow-prefect-defaults", "lean_server_vs_prefect_defaults")
    ratio("flow-health-check", "trellis-flow", "health_check_cost")
    ratio("trellis-flow", "trl", "flow_vs_trl")
    ratio("trellis-flow", "trellis", "flow_vs_engine")
    ratio("trellis", "trl", "ratio_vs_trl")


if __name__ == "__main__":
    main()
