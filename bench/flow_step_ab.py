"""Two variants of the orchestrated CPU step in one process, alternated in short blocks.

Usage: python bench/flow_step_ab.py MODEL_DIR TRAIN_PARQUET OUT_JSON --variant NAME [--rounds 12] [--block 12]

`trellis_flow_step.py` run twice (one process per side) cannot see a change of a few percent on this machine:
its speed moves by 10-20% from one minute to the next, and a run's start (Ray head, workers, warm-up) takes
most of its 80 s. Here one Ray head, one temporary Prefect server and one set of workers serve both sides:
after a warm-up run, each round runs the step loop (`rl_train`, continuing the same run) for BLOCK steps as
A and BLOCK steps as B, the order swapped every round (A B, B A, ...), so a side's neighbour in time is the
other side. Each block's step time is the median of the intervals between its consecutive `rl_step`
starts, from its second step on (its first re-attaches). Reported: per side the median over blocks with
min..max, and B/A paired within each round, with min..max over the rounds.

The variant names what B changes; it must be switchable inside one process (a setting, not another commit):

- ``artifacts-inline``: A posts the steps' artifacts in the background (trellis's default on its temporary
  server), B posts each while the step waits (as on a server trellis did not start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trellis_flow_step as flow_bench  # noqa: E402  (first: it sets the lean server's settings before Prefect loads)

import ray  # noqa: E402
from _compare import with_spread  # noqa: E402
from _measure import StepClock  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402

import trellis.flows.rl_train as rl_train_module  # noqa: E402


@contextmanager
def artifacts_inline() -> Iterator[None]:
    switch = rl_train_module.on_trellis_temporary_server
    rl_train_module.on_trellis_temporary_server = lambda: False
    try:
        yield
    finally:
        rl_train_module.on_trellis_temporary_server = switch


VARIANTS = {"artifacts-inline": artifacts_inline}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("train_path")
    parser.add_argument("out")
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=12)
    args = parser.parse_args()
    changed = VARIANTS[args.variant]
    head, address = flow_bench.start_head()
    blocks: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as tmp, temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            config = flow_bench.flow_step_config(args.model_dir, args.train_path, tmp, address)
            flow_bench.rl_train(config)
            done, clock = flow_bench.WARMUP_STEPS, StepClock()
            for round_ in range(1, args.rounds + 1):
                for side in ("A", "B") if round_ % 2 else ("B", "A"):
                    since_s = time.time()
                    clock.start()  # its CPU is the whole process tree's: Prefect's server and Ray's processes included
                    with changed() if side == "B" else nullcontext():
                        flow_bench.rl_train(config.model_copy(update={"total_train_steps": done + args.block}))
                    clock.stop()
                    cpu_s = clock.cpu[-1]
                    starts = asyncio.run(flow_bench.step_starts(since_s))
                    steps = range(done + 2, done + args.block)  # from the block's second step; the last has no successor
                    walls = [starts[s + 1] - starts[s] for s in steps]
                    blocks.append(dict(round=round_, side=side, step_s=statistics.median(walls), walls=walls,
                                       cpu_s_per_step=cpu_s / args.block))
                    done += args.block
                    print(f"round {round_} {side}: {statistics.median(walls):.3f} s/step", flush=True)
    finally:
        ray.shutdown()
        head.terminate()
        head.wait(timeout=60)
    report = summarize(blocks, args.variant)
    Path(args.out).write_text(json.dumps(dict(variant=args.variant, rounds=args.rounds, block=args.block, blocks=blocks,
                                              summary=report), indent=1))
    print("\n".join(report))


def summarize(blocks: list[dict], variant: str) -> list[str]:
    by = {(b["round"], b["side"]): b for b in blocks}
    rounds = sorted({b["round"] for b in blocks})
    lines = [f"B = A with {variant}; {len(rounds)} rounds, sides alternated"]
    for side in "AB":
        lines.append(f"{side}: step {with_spread(by[r, side]['step_s'] for r in rounds)} s, "
                     f"CPU {with_spread(by[r, side]['cpu_s_per_step'] for r in rounds)} CPU-s/step (process tree)")
    lines.append(f"B/A step, paired by round: {with_spread(by[r, 'B']['step_s'] / by[r, 'A']['step_s'] for r in rounds)}")
    lines.append(f"B/A CPU, paired by round: {with_spread(by[r, 'B']['cpu_s_per_step'] / by[r, 'A']['cpu_s_per_step'] for r in rounds)}")
    return lines


if __name__ == "__main__":
    main()
