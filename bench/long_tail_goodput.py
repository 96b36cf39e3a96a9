"""Where a long-tail asynchronous run's device-seconds go (``goodput/*``), through the real flow on CPU:
a Prefect flow run per step on a local Ray cluster, one trainer and one rollout worker.

The untrained tiny model never stops by itself, so every response runs to its prompt's cap (lognormal,
mean ``--mean-len``, 2..``--cap`` tokens: a long tail); max_staleness 1 with partial rollout. Printed:
the run's goodput %, each category's share of the device-seconds (engine.run.goodput), the tokens
behind the discarded shares, and the per-step goodput % with its spread.

Usage: python bench/long_tail_goodput.py OUT_DIR [--steps 30] [--trigger 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trellis.flows.prefect_settings import use_lean_temporary_server  # noqa: E402

use_lean_temporary_server()  # before Prefect is imported: the run starts its temporary server as the CLI does

from tail_lane import long_tail_config, long_tail_workspace  # noqa: E402

from trellis.engine.cluster.head import stop_head  # noqa: E402
from trellis.engine.storage.lake_query import goodput_device_seconds, run_goodput  # noqa: E402
from trellis.flows.rl_train import rl_train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trigger", type=int, default=0, help="replay_buffer.tail_batch_trigger_size")
    parser.add_argument("--cap", type=int, default=96)
    parser.add_argument("--mean-len", type=float, default=10.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work, model, data = long_tail_workspace("trellis-long-tail-", mean=args.mean_len, cap=args.cap)
    config = long_tail_config(work, model, data, name="long_tail", steps=args.steps, cap=args.cap, trigger=args.trigger)
    started = time.perf_counter()
    try:
        rl_train(config)
    finally:
        stop_head(config.cluster)
    wall = time.perf_counter() - started
    steps = {r["step"]: r for r in map(json.loads, Path(config.run_uri, "logs", "metrics.jsonl").read_text().splitlines())}
    seconds = goodput_device_seconds(steps)
    whole = sum(seconds.values())
    per_step = [r["goodput/percent"] for r in steps.values() if "goodput/percent" in r]
    tokens = {key: sum(r.get(key, 0.0) for r in steps.values()) for key in (
        "rollout/produced_tokens", "response/trained_response_tokens", "async/discarded_tokens/expired",
        "async/discarded_tokens/given_up", "async/discarded_tokens/filtered")}
    summary = {
        "command": " ".join(sys.argv), "run_wall_s": wall, "steps": len(steps),
        "run_goodput_percent": run_goodput(steps),
        "share_of_device_seconds": {k: v / whole for k, v in sorted(seconds.items())},
        "device_seconds": whole,
        "per_step_goodput_percent": {"median": statistics.median(per_step), "min": min(per_step), "max": max(per_step)},
        "tokens": tokens,
        "expired_groups": steps[max(steps)].get("async/expired_groups"),
        "e2e_trained_tokens_per_s": sum(r["response/training_tokens"] for r in steps.values()) / wall,
    }
    print(json.dumps(summary, indent=1))
    (args.out / f"long_tail_goodput_trigger{args.trigger}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
