"""engine_steps.py's GPU step, driven by the Prefect flow on a Ray cluster started here: what the
orchestration costs.

``--rounds`` rounds, alternated on one machine, each:
1. ``engine_steps.py --track`` in a child process (so its GPU memory is freed at exit): the steps in
   one process with no Prefect or Ray, writing trajectories and metrics as the flow does;
2. ``rl_train`` on a local Ray head started once: fresh trainer and rollout actors splitting the GPU
   (weights through CUDA IPC), warmed up by a first flow run, then a measured flow run with each
   step's rollout launched at the end of the previous step (``cluster.overlap_next_rollout``, the
   default) and, unless ``--early-launch-only``, one with the rollout launched by the step itself;
   the workers are released at the round's end.
Both sides leave the same 2 warm-up steps out and time the same ``--steps - 1`` steps the same way:
one step's start to the next one's (the flow's from its ``rl_step`` flow-run starts), everything a
user waits for. Every figure is a median with its spread (min .. max, n) over all rounds' steps, and
each round's flow / in-process ratio is given too.

Orchestration overhead = the part of each step in which no worker ran a method (from Ray's
timeline): the GPU workers waited on Prefect and the driver. Also: each phase's time on both sides
(``time/rollout`` is the batch's own generation and scoring), and a weight sync between the live
actors timed on its own.

    python bench/gpu/flow_steps.py OUT_DIR [--steps 5] [--rounds 2] [--backend vllm] [--resident-trainer] [--[no-]compile]
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

from trellis.flows.prefect_settings import use_lean_temporary_server  # noqa: E402

use_lean_temporary_server()  # before Prefect is imported (below), which reads its client settings then

import ray  # noqa: E402
import rollout_host  # noqa: E402
import torch  # noqa: E402
from engine_steps import add_step_arguments, result_path, run_settings, step_argv, step_config, vllm_child_env  # noqa: E402
from process_exit import exit_now  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402
from _compare import spread, with_spread  # noqa: E402
from _measure import busy_spans, idle_seconds  # noqa: E402
from trellis_flow_step import PHASES, WORKER_CALLS, start_head, step_starts  # noqa: E402

from trellis.engine.cluster import weight_sync  # noqa: E402
from trellis.engine.cluster.workers import RunWorkers  # noqa: E402
from trellis.flows.rl_train import rl_train  # noqa: E402

WARMUP_STEPS = 2
WORK = Path("/tmp/trellis-gpu")


def in_process_steps(args: argparse.Namespace) -> dict:
    """engine_steps.py with the flow's warm-up and number of measured steps: ``WARMUP_STEPS`` left out,
    then ``--steps`` more, of which the first ``--steps - 1`` are timed start to next start, as a
    flow run's are (its last step has no successor start)."""
    same_steps = argparse.Namespace(**{**vars(args), "steps": WARMUP_STEPS + args.steps})
    command = [sys.executable, str(Path(__file__).with_name("engine_steps.py")), *step_argv(same_steps), "--track",
               "--warmup", str(WARMUP_STEPS)]
    with open(args.out / "engine_steps.log", "a") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=vllm_child_env())
    return json.loads(result_path(args).read_text())


def timed_sync(config, repeats: int = 3) -> dict:
    """Syncs between the live actors, timed alone; a LoRA run's both ways (the adapters, and the merged
    weights as a full fine-tune syncs), with the bytes each sends."""
    trainer, rollout = RunWorkers(config).actor("trainer"), RunWorkers(config).actor("rollout")
    variants = {"configured": config}
    if config.lora is not None:
        for way in ("adapter", "full"):
            variants[f"lora_sync_{way}"] = config.model_copy(update={"lora": config.lora.model_copy(update={"sync": way})})
    timings = {}
    for name, variant in variants.items():
        seconds, transport = [], ""
        for _ in range(repeats):
            started = time.perf_counter()
            transport = weight_sync.push_weights(variant, trainer, rollout, policy_version=10_000)
            seconds.append(time.perf_counter() - started)
        timings[name] = {"transport": transport, "median_s": statistics.median(seconds), "all_s": seconds}
    if config.lora is not None:
        timings["bytes"] = ray.get(trainer.call.remote(sync_bytes))
    return {**timings.pop("configured"), **timings}


def trainer_compiled(worker) -> bool:
    """What the trainer resolved ``train_worker.compile`` (auto by default) to."""
    return worker.compiled


def trainer_stays_on_gpu(worker) -> bool | None:
    """What the trainer's last hand-over to the rollout decided (``offload_when_idle``; None on CPU)."""
    return worker.idle.stays_on_gpu


def sync_bytes(worker) -> dict:
    """What a LoRA sync sends (the adapters, float32) against the merged weights in the rollout's bf16."""
    from trellis.engine.weights.lora import payload_bytes

    return {"adapter": payload_bytes(worker.export_adapter()),
            "full_bf16": 2 * sum(t.numel() for t in worker.export_weights().values())}


def flow_round(args: argparse.Namespace, address: str) -> dict:
    """One round of the flow: fresh workers warmed up by a flow run of ``WARMUP_STEPS``, then one
    measured flow run of ``--steps`` per launch kind (early, then in-step unless --early-launch-only);
    the workers are released at the end, so the next in-process round starts on a free GPU."""
    vllm_site = os.environ.get("TRELLIS_VLLM_SITE")
    runtime_env = {"env_vars": {"PYTHONPATH": f"{vllm_site}:${{PYTHONPATH}}"}} if vllm_site else None
    with tempfile.TemporaryDirectory() as tmp, temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        config = step_config(
            WORK, args, total_train_steps=WARMUP_STEPS, work_dir=tmp, experiment_name="flow_bench",
            rollout={"runtime_env": runtime_env},
            cluster={"address": address, "release_workers_at_end": False, "torch_threads": args.torch_threads or 4,
                     "home": str(WORK / "cluster")},  # its token file, not the user's ~/.trellis
        )
        started = time.perf_counter()
        rl_train(config)
        warmup_run_s = time.perf_counter() - started  # the workers' start, model loads and compile included
        compiled = ray.get(RunWorkers(config).actor("trainer").call.remote(trainer_compiled))
        rollout_actor = RunWorkers(config).actor("rollout")
        probed = ray.get(rollout_actor.call.remote(rollout_host.install)) if args.probe_rollout else None
        since_s, total, measured = time.time(), WARMUP_STEPS, {True: [], False: []}
        for overlap in (True,) if args.early_launch_only else (True, False):
            total += args.steps
            cluster = config.cluster.model_copy(update={"overlap_next_rollout": overlap})
            rl_train(config.model_copy(update={"total_train_steps": total, "cluster": cluster}))
            measured[overlap] += range(total - args.steps + 1, total)  # a run's last step has no successor start
        starts = asyncio.run(step_starts(since_s))
        spans = busy_spans(ray.timeline(), WORKER_CALLS)
        lines = (Path(tmp) / "flow_bench" / "logs" / "metrics.jsonl").read_text().splitlines()
        records = {r["step"]: r for r in map(json.loads, lines)}
        host = ray.get(rollout_actor.call.remote(rollout_host.records)) if args.probe_rollout else None
        stays = ray.get(RunWorkers(config).actor("trainer").call.remote(trainer_stays_on_gpu))
        sync = timed_sync(config)
        RunWorkers(config).release()
    modes = {}
    for overlap, steps in measured.items():
        if steps:
            modes["overlap" if overlap else "in_step"] = {
                "steps_s": [starts[s + 1] - starts[s] for s in steps],
                "idle_s": [idle_seconds(spans, starts[s], starts[s + 1]) for s in steps],
                "phases_s": {p: [records[s].get(p, 0.0) for s in steps] for p in PHASES},
            }
    every = measured[True] + measured[False]
    return {
        "settings": {**run_settings(config), "compiled": compiled, "trainer_stays_on_gpu": stays},
        "warmup_run_s": warmup_run_s,
        "warmup_phases_s": {p: [records[s].get(p, 0.0) for s in range(1, WARMUP_STEPS + 1)] for p in PHASES},
        "modes": modes,
        "mismatch_k3": [records[s]["mismatch/k3_kl"] for s in every if "mismatch/k3_kl" in records[s]],
        "weight_sync_between_actors": sync,
        "steps": [records[s] for s in sorted(every)],
        **({"rollout_host": {"process": probed, "calls": host}} if args.probe_rollout else {}),
    }


def summarize_mode(rounds: list[dict], mode: str) -> dict:
    steps = [wall for r in rounds for wall in r["flow"]["modes"][mode]["steps_s"]]
    idle = [i for r in rounds for i in r["flow"]["modes"][mode]["idle_s"]]
    phases = {p: [v for r in rounds for v in r["flow"]["modes"][mode]["phases_s"][p]] for p in PHASES}
    return {
        "step_s": spread(steps),
        "steps_s": steps,
        "workers_idle_fraction": sum(idle) / sum(steps),
        "phase_s": {p: spread(values) for p, values in phases.items()},
        "phases_s": phases,
        "round_medians_s": [statistics.median(r["flow"]["modes"][mode]["steps_s"]) for r in rounds],
    }


def against_in_process(rounds: list[dict], default: dict) -> dict:
    """The in-process steps of every round beside the flow's: spread, phases, ratios overall and by round."""
    in_process = [wall for r in rounds for wall in r["in_process"]["wall_steps_s"]]
    local_median = statistics.median(in_process)
    local_rounds = [statistics.median(r["in_process"]["wall_steps_s"]) for r in rounds]
    measured = slice(WARMUP_STEPS, WARMUP_STEPS + len(rounds[0]["in_process"]["wall_steps_s"]))
    return {
        "in_process_step_s": spread(in_process),
        "in_process_steps_s": in_process,
        "in_process_spread_vs_median": [min(in_process) / local_median - 1, max(in_process) / local_median - 1],
        "in_process_round_medians_s": local_rounds,
        "in_process_phase_s": {
            p: spread(step[p] for r in rounds for step in r["in_process"]["steps"][measured] if p in step)
            for p in PHASES if any(p in step for r in rounds for step in r["in_process"]["steps"][measured])
        },
        "flow_vs_in_process": default["step_s"]["median"] / local_median,
        "flow_vs_in_process_by_round": [f / i for f, i in zip(default["round_medians_s"], local_rounds)],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    add_step_arguments(parser, steps=5, backend="vllm")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (in-process run, flow runs), alternated")
    parser.add_argument("--early-launch-only", action="store_true", help="only the default: each rollout launched early")
    parser.add_argument("--flow-only", action="store_true", help="no in-process runs (a peer bench compares the flow alone)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.probe_rollout:
        ray.cloudpickle.register_pickle_by_value(rollout_host)  # the rollout actor has no bench/ on its path
    gpu_busy = rollout_host.sample_gpu_busy(args.out / "gpu_busy.csv") if args.probe_rollout else None
    head, address = start_head(f"--num-gpus={torch.cuda.device_count()}")
    rounds = []
    try:  # the results are written before Ray shuts down: a late call into a shut-down Ray ends the process
        for number in range(1, args.rounds + 1):
            local = None if args.flow_only else in_process_steps(args)
            if local:
                print(f"round {number} in-process: {with_spread(local['wall_steps_s'])} s/step", flush=True)
            flow = flow_round(args, address)
            print(f"round {number} flow: {with_spread(flow['modes']['overlap']['steps_s'])} s/step", flush=True)
            rounds.append({"in_process": local, "flow": flow})
        write_summary(args, rounds)
    finally:
        ray.shutdown()
        head.terminate()
        head.wait(timeout=60)
        if gpu_busy is not None:
            gpu_busy.terminate()


def write_summary(args: argparse.Namespace, rounds: list[dict]) -> None:
    modes = {mode: summarize_mode(rounds, mode) for mode in rounds[0]["flow"]["modes"]}
    default = modes["overlap"]
    summary = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "backend": args.backend,
        "resident_trainer": args.resident_trainer,
        "compile": args.compile,
        "samples_per_step": args.prompts * args.group,
        "rounds": args.rounds,
        "warmup_steps": WARMUP_STEPS,
        "measured_steps_per_round": args.steps - 1,
        "flow_step_s": default["step_s"],
        "flow_spread_vs_median": [default["step_s"]["min"] / default["step_s"]["median"] - 1,
                                  default["step_s"]["max"] / default["step_s"]["median"] - 1],
        "orchestration_overhead": default["workers_idle_fraction"],
        "modes": modes,
        "settings": rounds[0]["flow"]["settings"],
        "weight_sync_between_actors": [r["flow"]["weight_sync_between_actors"] for r in rounds],
        "mismatch_k3": [v for r in rounds for v in r["flow"]["mismatch_k3"]],
        "warmup_run_s": [r["flow"]["warmup_run_s"] for r in rounds],
        "warmup_phases_s": [r["flow"]["warmup_phases_s"] for r in rounds],
    }
    if not args.flow_only:
        summary.update(against_in_process(rounds, default))
    print(json.dumps({k: v for k, v in summary.items() if not k.endswith("steps_s")}, indent=1), flush=True)
    summary["flow_steps"] = [step for r in rounds for step in r["flow"]["steps"]]
    if args.probe_rollout:
        busy = rollout_host.read_gpu_busy(args.out / "gpu_busy.csv")
        summary["rollout_host"] = {
            "flow": [rollout_host.with_gpu_busy(r["flow"]["rollout_host"], busy) for r in rounds],
            "in_process": [rollout_host.with_gpu_busy(r["in_process"]["rollout_host"], busy)
                           for r in rounds if r["in_process"] and "rollout_host" in r["in_process"]],
        }
    (args.out / f"flow_steps_{args.backend}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
    exit_now()
