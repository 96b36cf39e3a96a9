"""trellis's colocated GPU step against TRL's GRPOTrainer with vLLM colocated, on one GPU, in one call.

Both train the same random Qwen2-0.5B-shaped model on the bundled task with the same batch: 32 prompts
x 8 samples = 256 completions of up to 256 new tokens per optimizer step, fp32 master weights under
bf16 autocast, no KL term, the same learning rate and temperature, vLLM for generation with the same
``--vllm-memory`` fraction of the GPU (0.3 by default) on both sides, the trainer resident and vLLM
awake through the fit (TRL: no sleep mode; trellis: its defaults, which keep each where the GPU holds both,
read back from its records), the same torch threads (``--torch-threads``) in every process that computes. The
contestants:

- ``trl``: GRPOTrainer, ``vllm_mode="colocate"``, per-device batch 32 x 8 accumulation steps,
  ``vllm_enable_sleep_mode=False``, ``gradient_checkpointing=False`` (TRL's GRPO default recomputes
  activations; trellis's does not), not compiled (TRL's default), in a child process;
- ``trellis``: ``flow_steps.py --backend vllm --early-launch-only --flow-only`` with trellis's defaults:
  ``train_worker.compile: auto`` (compiled decoder layers on a GPU), ``offload_when_idle: auto`` (the
  trainer stays on the GPU beside vLLM's share, read back from the trainer), the Prefect flow
  on a fresh local Ray cluster (trainer and rollout actors sharing the GPU); flow_steps.py compares it
  with the in-process step on its own;
- ``trellis-eager``: the same with ``compile: false``; ``trellis-compiled``: with ``compile: true``;
  ``trellis-asleep``: with ``rollout.sleep_level: 1``, vLLM asleep through every fit, the default before
  ``auto`` (which keeps it awake where the fit fits beside it): what a sleep and a wake cost a step.

They run alternately, ``--rounds`` times (trl, trellis, trellis-eager, trl, ...), each in its own
process, so each starts on a free GPU. The settings each side really ran with (read back from its own
records) are printed side by side and checked equal first. Figures per contestant, as the median over
the rounds with the spread (min .. max) beside it: the median step wall time after the warm-up (2 steps
on each side: trellis's warm-up flow run, TRL's first two steps; the settings table reads it back from
each side's output); trained response tokens per second = the response tokens, up to and including
EOS, of every sample each side trained in the measured steps, counted the same way from each side's
own records (TRL: the length of every completion's ``completion_ids``, cut after its EOS as TRL's
completion mask is, summed in the reward function; trellis: ``response/response_len/mean`` x
``response/batch_size``, the samples that mean is over), over the sum of those steps' wall times; the
peak GPU memory the device reported (``nvidia-smi``, sampled every 0.2 s, so vLLM's pool counts for
both). What trellis's first step costs: its warm-up flow run (workers started, models loaded, the
compile) and its first step's ``time/fit``, beside the eager run's (torch's compile caches are warm
from a run's second compiled contestant on). A step's wall time is TRL's ``on_step_begin`` to
``on_step_end``, trellis's from one ``rl_step`` flow run's start to the next one's (everything the user
waits for, so it can only favour TRL; trellis runs one step more than it measures, whose start ends the
last measured one).

    python bench/gpu/trl_peer.py OUT_DIR [--steps 6] [--rounds 2] [--order trl,trellis,trellis-eager]
        [--vllm-memory 0.3] [--smoke]

Where one call's time limit holds fewer runs than two rounds, make each round in a call of its own on
the same machine (``--rounds 1 --round K``, alternating the order: ``--order trl,trellis`` then
``--order trellis,trl``), then ``--combine OUT_DIR...`` reports over them as one alternated run.

writes OUT_DIR/h200_trl_peer.json (``--smoke``: cpu_smoke_trl_peer.json). ``--trellis-compile``, the
old spelling, makes ``trellis`` in ``--order`` the compiled one. ``--smoke`` runs on CPU: the tiny
model, the transformers rollout on both sides (no vLLM), 4 x 4 samples of 8 tokens, 4 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/, for _compare
sys.path.insert(0, str(HERE))
from _compare import alternated  # noqa: E402
from host_load import add_end_leftovers_argument  # noqa: E402
from peer_report import combined_runs, report, run_contestant  # noqa: E402
from peer_workload import TOKENS_COUNTED, WARMUP_STEPS, WORK, model_dir, prepare_model_and_data, run_child, shared  # noqa: E402
from run_facts import files_digest, weights_digest  # noqa: E402

CONTESTANTS = ("trl", "trellis", "trellis-eager", "trellis-compiled", "trellis-asleep")
CONTESTANT_FLAGS = {"trellis": [], "trellis-eager": ["--no-compile"], "trellis-compiled": ["--compile"],  # trellis: the default
                    "trellis-asleep": ["--sleep-level", "1"]}
DIFFER_BY_DESIGN = {"compiled": "trellis runs both ways; TRL keeps its default", "tokens counted from": "each side's own records",
                    "vLLM asleep during the fit": "each side's default (trellis: rollout.sleep_level auto, asleep where a fit "
                                                  "needs the memory; TRL: no sleep mode)"}


def trl_contestant(args: argparse.Namespace, round_: int) -> dict:
    out = args.out / f"trl_{round_}.json"
    from engine_steps import vllm_child_env

    env = vllm_child_env()  # vLLM runs in TRL's own process
    command = [sys.executable, str(HERE / "trl_runner.py"), str(out), "--steps", str(args.steps),
               "--vllm-memory", str(args.vllm_memory), "--torch-threads", str(args.torch_threads)] + (["--smoke"] if args.smoke else [])
    peak_gib = run_child(command, args.out / f"trl_{round_}.log", env)
    result = json.loads(out.read_text())
    measured = slice(WARMUP_STEPS, None)
    wall, tokens = result["step_s"][measured], result["response_tokens"][measured]
    rollout = result["generate_s"][measured]
    return {"step_s": statistics.median(wall), "steps_s": result["step_s"], "trained_response_tokens": sum(tokens),
            "rollout_s": statistics.median(rollout) if any(rollout) else None, "rollouts_s": result["generate_s"],
            "trained_response_tokens_per_s": sum(tokens) / sum(wall), "response_len_mean": sum(tokens) / sum(result["completions"][measured]),
            "peak_gpu_gib": peak_gib, "settings": {**result["settings"], "measured steps": len(wall)}, "trl": result["versions"]}


def trellis_contestant(args: argparse.Namespace, round_: int, name: str) -> dict:
    out = args.out / f"{name.replace('-', '_')}_{round_}"
    step = shared(args)
    command = [sys.executable, str(HERE / "flow_steps.py"), str(out), "--early-launch-only", "--flow-only",
               "--backend", "transformers" if args.smoke else "vllm", "--steps", str(args.steps - WARMUP_STEPS + 1), "--rounds", "1",
               "--prompts", str(step["prompts"]), "--group", str(step["group"]), "--new-tokens", str(step["new_tokens"]),
               "--vllm-memory", str(args.vllm_memory), "--lr", str(step["lr"]), "--model", str(model_dir(args)),
               "--torch-threads", str(args.torch_threads)]
    peak_gib = run_child(command + CONTESTANT_FLAGS[name], args.out / f"{out.name}.log", dict(os.environ))
    result = json.loads((out / f"flow_steps_{'transformers' if args.smoke else 'vllm'}.json").read_text())
    flow = result["modes"]["overlap"]
    records = {r["step"]: r for r in result["flow_steps"]}
    steps = sorted(records)[: len(flow["steps_s"])]  # the measured steps; each has a successor whose start ends it
    tokens = [trained_response_tokens(records[s]) for s in steps]
    samples = sum(records[s]["response/batch_size"] for s in steps)
    return {"step_s": flow["step_s"]["median"], "steps_s": flow["steps_s"], "trained_response_tokens": sum(tokens),
            "trained_response_tokens_per_s": sum(tokens) / sum(flow["steps_s"]), "response_len_mean": sum(tokens) / samples,
            "workers_idle_fraction": flow["workers_idle_fraction"], "peak_gpu_gib": peak_gib,
            "warmup_run_s": result["warmup_run_s"][0], "first_fit_s": result["warmup_phases_s"][0]["time/fit"][0],
            "measured_fit_s": flow["phase_s"]["time/fit"]["median"], "rollout_s": flow["phase_s"]["time/rollout"]["median"],
            "rollouts_s": flow["phases_s"]["time/rollout"],
            "settings": {**trellis_settings(result["settings"], on_gpu=result["device"] != "cpu",
                                            awake=[records[s].get("memory/engine_awake") for s in steps]),
                         "warm-up steps": result["warmup_steps"], "measured steps": len(steps)}}


def trained_response_tokens(record: dict) -> float:
    """The response tokens (up to and including EOS) of every sample a trellis step trained: the mean
    length times the number of samples it is the mean over (TRL counts ``completion_ids`` the same way)."""
    return record["response/response_len/mean"] * record["response/batch_size"]


def trellis_settings(config: dict, *, on_gpu: bool, awake: list[float | None]) -> dict:
    """``awake``: each measured fit's ``memory/engine_awake`` (recorded where ``rollout.sleep_level`` is auto)."""
    rollout, vllm = config["rollout"], config["rollout"]["backend"] == "vllm"
    worker = config["train_worker"]
    bf16 = on_gpu and worker["dtype"] in ("auto", "bfloat16")  # engine/train/worker.py: fp32 weights, bf16 compute
    return {
        "model (weights digest)": f"{Path(config['load_from']).name} ({weights_digest(Path(config['load_from']))})",
        "prompts file digest": files_digest([Path(config["train_dataset"]["path"])]),
        "prompts x samples per step": f"{config['train_batch_size']} x {config['prompt_repeat_k']}",
        "max new tokens": rollout["max_new_tokens"],
        "rollout engine": rollout["backend"],
        "vLLM gpu_memory_utilization": rollout["gpu_memory_utilization"] if vllm else "no vLLM",
        "temperature": rollout["temperature"],
        "learning rate": config["optim"]["lr"],
        "KL coefficient": config["loss"]["kl_coef"],
        "optimizer steps per batch": config["train_worker"]["optimizer_steps"],
        # offload_when_idle auto decides at run time; the trainer says what it did (None: on CPU, nothing moves)
        "trainer resident (no offload)": config.get("trainer_stays_on_gpu") is not False,
        "vLLM asleep during the fit": vllm and engine_slept(rollout["sleep_level"], awake),
        "torch threads (CPU ops)": config["cluster"]["torch_threads"],
        "activation checkpointing": config["train_worker"]["gradient_checkpointing"],
        "weights / compute dtype": f"float32 / {'bfloat16' if bf16 else 'float32'}",
        "compiled": f"{config['compiled']} (compile: {config['train_worker']['compile']})",
        "tokens counted": TOKENS_COUNTED,
        "tokens counted from": "step metrics: response_len/mean x batch_size",
    }


def engine_slept(sleep_level: str | int, awake: list[float | None]) -> bool:
    """Whether vLLM slept through any measured fit: under auto, as each fit recorded it."""
    return 0.0 in awake if sleep_level == "auto" else sleep_level != 0


def contestants(args: argparse.Namespace) -> list[str]:
    names = args.order.split(",")
    if args.trellis_compile:  # the old spelling: "trellis" meant the compiled one
        names = ["trellis-compiled" if name == "trellis" else name for name in names]
    unknown = set(names) - set(CONTESTANTS)
    if unknown:
        raise SystemExit(f"--order: unknown contestant(s) {sorted(unknown)}; choose from {', '.join(CONTESTANTS)}")
    if "trl" in names and not trl_installed():
        print("TRL is not installed here (make bench installs it): the trl contestant is left out.", flush=True)
        names.remove("trl")
    return list(dict.fromkeys(names))


def trl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


FIGURES = {"step_s": ".3f", "trained_response_tokens_per_s": ",.0f", "trained_response_tokens": ",.0f", "response_len_mean": ".1f",
           "peak_gpu_gib": ".1f", "workers_idle_fraction": ".3f", "warmup_run_s": ".1f", "first_fit_s": ".2f", "measured_fit_s": ".2f",
           "rollout_s": ".2f", "core_loop_ms_median": ".1f"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=6, help=f"optimizer steps per contestant, the first {WARMUP_STEPS} not measured")
    parser.add_argument("--rounds", type=int, default=2, help="of every contestant, alternated")
    parser.add_argument("--order", default=",".join(CONTESTANTS), help="the contestants, in their order within a round")
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="the GPU fraction vLLM takes, on both sides")
    parser.add_argument("--torch-threads", type=int, default=min(4, os.cpu_count() or 1),
                        help="torch threads of every process that computes, on both sides")
    parser.add_argument("--trellis-compile", action="store_true", help="the old spelling: 'trellis' in --order is compiled")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny model, transformers rollout, a few steps")
    add_end_leftovers_argument(parser)
    parser.add_argument("--round", type=int, help="the first round's number, for a call that makes one round of --combine's")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="CALL_FOLDER",
                        help="no run: the report over earlier calls' folders, in the order they ran")
    args = parser.parse_args()
    if args.smoke:
        args.steps = min(args.steps, WARMUP_STEPS + 2)
    if args.steps < WARMUP_STEPS + 2:
        parser.error(f"--steps: {WARMUP_STEPS} warm-up steps and at least 2 measured ones")
    if args.rounds < 2 and args.round is None and not args.combine:
        parser.error("--rounds: a comparison needs at least two rounds of each contestant, alternated (or rounds in "
                     "calls of their own, --rounds 1 --round K, then --combine)")
    args.out.mkdir(parents=True, exist_ok=True)
    report_file = args.out / ("cpu_smoke_trl_peer.json" if args.smoke else "h200_trl_peer.json")
    if args.combine:
        runs, order = combined_runs(args.combine)
        report_file.write_text(json.dumps(trl_report(args, runs, order), indent=1))
        return
    WORK.mkdir(parents=True, exist_ok=True)
    prepare_model_and_data(args)
    names = contestants(args)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    order = [(round_ + (args.round or 1) - 1, name) for round_, name in alternated(names, args.rounds)]
    print("order:", " ".join(f"{name}[{round_}]" for round_, name in order), flush=True)
    for done, (round_, name) in enumerate(order, 1):
        run = partial(trl_contestant, args, round_) if name == "trl" else partial(trellis_contestant, args, round_, name)
        runs[name].append(run_contestant(f"round {round_} {name}", run, end_leftovers_first=args.end_leftovers))
        r = runs[name][-1]
        print(f"round {round_} {name:16s} " + (r["error"] if "error" in r else
              f"step median {r['step_s']:.3f} s  trained response tokens/s {r['trained_response_tokens_per_s']:,.0f}  "
              f"trained response tokens {r['trained_response_tokens']:,.0f}"), flush=True)
        (args.out / "runs_so_far.json").write_text(json.dumps(runs, indent=1))  # what a call cut short still returns
        (args.out / "order_so_far.json").write_text(json.dumps(order[:done]))
    summary = trl_report(args, runs, order)
    report_file.write_text(json.dumps(summary, indent=1))
    if summary["unequal_settings"]:
        os._exit(1)


def trl_report(args: argparse.Namespace, runs: dict[str, list[dict]], order: list[tuple[int, str]]) -> dict:
    return report(args, runs, order, peer="trl", figure_formats=FIGURES, differ_by_design=DIFFER_BY_DESIGN, warmup_steps=WARMUP_STEPS)


if __name__ == "__main__":
    main()
