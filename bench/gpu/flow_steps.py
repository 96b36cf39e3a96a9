"""engine_steps.py's GPU step, driven by the Prefect flow on a Ray cluster started here: what the
orchestration costs.

Same machine, same config, one after the other:
1. ``engine_steps.py --track`` in a child process (so its GPU memory is freed at exit): the steps in
   one process with no Prefect or Ray, writing trajectories and metrics as the flow does, with the
   flow's warm-up (2 steps) and as many measured steps as one flow run below measures;
2. ``rl_train`` on a fresh local Ray head. The trainer and rollout actors split the GPU and weights
   move between them through CUDA IPC. A first flow run warms the workers up and keeps them; then
   flow runs of ``--steps`` steps each re-attach to them, alternately with each step's rollout
   launched at the end of the previous step (``cluster.overlap_next_rollout``, the default) and by
   the step itself, ``--rounds`` times each. Steps are timed between consecutive ``rl_step`` flow-run
   starts (everything a user waits for).

Orchestration overhead = the part of each step in which no worker ran a method (from Ray's
timeline): the GPU workers waited on Prefect and the driver. Also reported: 1 - in-process step /
flow step, and a weight sync between the live actors timed on its own.

    python bench/gpu/flow_steps.py OUT_DIR [--steps 5] [--rounds 2] [--backend vllm] [--resident-trainer] [--compile]
        [--early-launch-only] [engine_steps.py's other options: --vllm-memory, --lr, --model ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for trellis_flow_step's helpers

from flows.prefect_settings import use_lean_temporary_server  # noqa: E402

use_lean_temporary_server()  # before Prefect is imported (below), which reads its client settings then

import ray  # noqa: E402
import torch  # noqa: E402
from engine_steps import add_step_arguments, result_path, run_settings, step_argv, step_config  # noqa: E402
from process_exit import exit_now  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402
from _measure import busy_spans, idle_seconds  # noqa: E402
from trellis_flow_step import PHASES, WORKER_CLASSES, start_head, step_starts  # noqa: E402

from engine.cluster import weight_sync  # noqa: E402
from engine.cluster.workers import RunWorkers  # noqa: E402
from flows.rl_train import rl_train  # noqa: E402

WARMUP_STEPS = 2
WORK = Path("/tmp/trellis-gpu")


def in_process_steps(args: argparse.Namespace) -> dict:
    """engine_steps.py with the flow's warm-up and number of measured steps: ``WARMUP_STEPS`` left out,
    then as many as one flow run of ``--steps`` measures (its last step has no successor start)."""
    same_steps = argparse.Namespace(**{**vars(args), "steps": WARMUP_STEPS + args.steps - 1})
    command = [sys.executable, str(Path(__file__).with_name("engine_steps.py")), *step_argv(same_steps), "--track",
               "--warmup", str(WARMUP_STEPS)]
    env = dict(os.environ)
    if os.environ.get("TRELLIS_VLLM_SITE"):  # vLLM runs in that process; this one keeps Prefect's fastapi
        env["PYTHONPATH"] = f"{os.environ['TRELLIS_VLLM_SITE']}:{env.get('PYTHONPATH', '')}"
    with open(args.out / "engine_steps.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    return json.loads(result_path(args).read_text())


def timed_sync(config, repeats: int = 3) -> dict:
    trainer, rollout = RunWorkers(config).actor("trainer"), RunWorkers(config).actor("rollout")
    seconds, transport = [], ""
    for _ in range(repeats):
        started = time.perf_counter()
        transport = weight_sync.push_weights(config, trainer, rollout, policy_version=10_000)
        seconds.append(time.perf_counter() - started)
    return {"transport": transport, "median_s": statistics.median(seconds), "all_s": seconds}


def flow_steps(args: argparse.Namespace) -> dict:
    gpus = torch.cuda.device_count()
    head, address = start_head(f"--num-gpus={gpus}")
    vllm_site = os.environ.get("TRELLIS_VLLM_SITE")
    runtime_env = {"env_vars": {"PYTHONPATH": f"{vllm_site}:${{PYTHONPATH}}"}} if vllm_site else None
    try:
        with tempfile.TemporaryDirectory() as tmp, temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            config = step_config(
                WORK, args, total_train_steps=WARMUP_STEPS, work_dir=tmp, experiment_name="flow_bench",
                rollout={"runtime_env": runtime_env},
                cluster={"address": address, "release_workers_at_end": False, "torch_threads": args.torch_threads or 4,
                         "home": str(WORK / "cluster")},  # its token file, not the user's ~/.trellis
            )
            rl_train(config)
            since_s, total, measured = time.time(), WARMUP_STEPS, {True: [], False: []}
            launches = (True,) if args.early_launch_only else (True, False)
            for overlap in launches * args.rounds:
                total += args.steps
                cluster = config.cluster.model_copy(update={"overlap_next_rollout": overlap})
                rl_train(config.model_copy(update={"total_train_steps": total, "cluster": cluster}))
                measured[overlap] += range(total - args.steps + 1, total)  # a run's last step has no successor start
            starts = asyncio.run(step_starts(since_s))
            spans = busy_spans(ray.timeline(), WORKER_CLASSES)
            lines = (Path(tmp) / "flow_bench" / "logs" / "metrics.jsonl").read_text().splitlines()
            records = {r["step"]: r for r in map(json.loads, lines)}
            sync = timed_sync(config)
            RunWorkers(config).release()
        modes = {}
        for overlap, steps in measured.items():
            if not steps:  # --early-launch-only
                continue
            wall = [starts[s + 1] - starts[s] for s in steps]
            idle = [idle_seconds(spans, starts[s], starts[s + 1]) for s in steps]
            modes["overlap" if overlap else "in_step"] = {
                "step_s": statistics.median(wall),
                "steps_s": wall,
                "workers_idle_s": statistics.median(idle),
                "workers_idle_fraction": sum(idle) / sum(wall),
                "phase_median_s": {p: statistics.median(records[s].get(p, 0.0) for s in steps) for p in PHASES},
            }
        every = measured[True] + measured[False]
        return {
            "gpus_in_cluster": gpus,
            "settings": run_settings(config),
            "warmup_steps": WARMUP_STEPS,
            "measured_steps_per_flow_run": args.steps - 1,
            "modes": modes,
            "mismatch_k3_median": statistics.median(records[s]["mismatch/k3_kl"] for s in every)
            if "mismatch/k3_kl" in records[every[0]] else None,
            "weight_sync_between_actors": sync,
            "steps": [records[s] for s in sorted(every)],
        }
    finally:
        ray.shutdown()
        head.terminate()
        head.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_step_arguments(parser, steps=5, backend="vllm")
    parser.add_argument("--rounds", type=int, default=2, help="flow runs of each kind, alternated")
    parser.add_argument("--early-launch-only", action="store_true", help="only the default: each rollout launched early")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    local = in_process_steps(args)
    flow = flow_steps(args)
    default = flow["modes"]["overlap"]
    summary = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "backend": args.backend,
        "resident_trainer": args.resident_trainer,
        "compile": args.compile,
        "samples_per_step": args.prompts * args.group,
        "in_process_step_s": local["step_s"],
        "flow_step_s": default["step_s"],
        "orchestration_overhead": default["workers_idle_fraction"],
        "flow_vs_in_process": 1.0 - local["step_s"] / default["step_s"],
        "in_process_phase_median_s": local["phase_median_s"],
        **{k: v for k, v in flow.items() if k != "steps"},
    }
    print(json.dumps(summary, indent=1), flush=True)
    summary["flow_steps"] = flow["steps"]
    (args.out / f"flow_steps_{args.backend}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
    exit_now()
