"""engine_steps.py's GPU step, driven by the Prefect flow on a Ray cluster started here: what the
orchestration costs.

Same machine, same config, one after the other:
1. ``engine_steps.py --track`` in a child process (so its GPU memory is freed at exit): the steps in
   one process with no Prefect or Ray, writing trajectories and metrics as the flow does;
2. ``rl_train`` on a fresh local Ray head. The trainer and rollout actors split the GPU and weights
   move between them through CUDA IPC. A first flow run warms the workers up and keeps them; a
   second one re-attaches and runs the measured steps, timed between consecutive ``rl_step``
   flow-run starts (everything a user waits for).

Overhead = 1 - in-process step / flow step. Also reported: the flow step minus its phase times, and
a weight sync between the live actors timed on its own.

    python bench/gpu/flow_steps.py OUT_DIR [--steps 6] [--backend vllm] [--resident-trainer]
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

import ray  # noqa: E402
import torch  # noqa: E402
from engine_steps import add_step_arguments, result_path, step_argv, step_config  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402
from trellis_flow_step import PHASES, start_head, step_starts  # noqa: E402

from engine import actors  # noqa: E402
from flows.rl_train import rl_train  # noqa: E402

WARMUP_STEPS = 2
WORK = Path("/tmp/trellis-gpu")


def in_process_steps(args: argparse.Namespace) -> dict:
    command = [sys.executable, str(Path(__file__).with_name("engine_steps.py")), *step_argv(args), "--track"]
    env = dict(os.environ)
    if os.environ.get("TRELLIS_VLLM_SITE"):  # vLLM runs in that process; this one keeps Prefect's fastapi
        env["PYTHONPATH"] = f"{os.environ['TRELLIS_VLLM_SITE']}:{env.get('PYTHONPATH', '')}"
    with open(args.out / "engine_steps.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    return json.loads(result_path(args).read_text())


def timed_sync(config, repeats: int = 3) -> dict:
    trainer, rollout = actors.lookup(config, "trainer"), actors.lookup(config, "rollout")
    seconds, transport = [], ""
    for _ in range(repeats):
        started = time.perf_counter()
        transport = actors.push_weights(config, trainer, rollout, policy_version=10_000)
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
                cluster={"address": address, "release_workers_at_end": False, "torch_threads": 4},
            )
            rl_train(config)
            since_s = time.time()
            rl_train(config.model_copy(update={"total_train_steps": WARMUP_STEPS + args.steps}))
            starts = asyncio.run(step_starts(since_s))
            lines = (Path(tmp) / "flow_bench" / "logs" / "metrics.jsonl").read_text().splitlines()
            records = {r["step"]: r for r in map(json.loads, lines)}
            measured = range(WARMUP_STEPS + 1, WARMUP_STEPS + args.steps)  # the last step has no successor start
            wall = [starts[s + 1] - starts[s] for s in measured]
            unaccounted = [starts[s + 1] - starts[s] - sum(records[s].get(p, 0.0) for p in PHASES) for s in measured]
            sync = timed_sync(config)
            actors.release_workers(config)
            return {
                "gpus_in_cluster": gpus,
                "step_s": statistics.median(wall),
                "steps_s": wall,
                "flow_step_minus_phases_s": statistics.median(unaccounted),
                "phase_median_s": {p: statistics.median(records[s].get(p, 0.0) for s in measured) for p in PHASES},
                "mismatch_k3_median": statistics.median(records[s]["mismatch/k3_kl"] for s in measured)
                if "mismatch/k3_kl" in records[WARMUP_STEPS + 1] else None,
                "weight_sync_between_actors": sync,
                "steps": [records[s] for s in measured],
            }
    finally:
        ray.shutdown()
        head.terminate()
        head.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_step_arguments(parser, steps=6, backend="vllm")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    local = in_process_steps(args)
    flow = flow_steps(args)
    summary = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "backend": args.backend,
        "resident_trainer": args.resident_trainer,
        "samples_per_step": args.prompts * args.group,
        "in_process_step_s": local["step_s"],
        "flow_step_s": flow["step_s"],
        "orchestration_overhead": 1.0 - local["step_s"] / flow["step_s"],
        "in_process_phase_median_s": local["phase_median_s"],
        **{k: v for k, v in flow.items() if k != "steps"},
    }
    print(json.dumps(summary, indent=1), flush=True)
    summary["flow_steps"] = flow["steps"]
    (args.out / f"flow_steps_{args.backend}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads would hold the process open
