"""What attesting every weight sync costs on one GPU, and a garbled sync caught there (vLLM rollout).

1. Cost: ``--rounds`` rounds of ``engine_steps.py`` runs (in process, random 0.5B shape by default),
   attestation on and off, the order swapped every round, each a fresh child process with the same
   steps and warm-up. Reported, each with its spread: the step time with attestation on over off per
   round (end to end, what the user waits for), each measured step's ``time/attest`` over its
   ``time/step`` (the comparison of the evidence alone), and the canary's logprob differences between
   the trainer and vLLM (what ``attest.canary_tolerance`` must leave room for).
2. Faults (``--faults``): one run with attestation on in which step 2's sync arrives with one bucket's
   bytes flipped once (``rollout.corrupt_received``: caught by the checksums, synced again, the step
   goes on), then step 3's engine loads flipped weights twice (``rollout.corrupt_applied``: only the
   canary can see it; the step fails), after which vLLM must refuse to generate.

    python bench/gpu/attest_steps.py OUT_DIR [--rounds 2] [--faults] [engine_steps.py's options: --steps 6 --warmup 2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engine_steps import add_step_arguments, result_path, step_argv, step_config, vllm_child_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for _compare
from _compare import spread, with_spread  # noqa: E402


def cost_run(args: argparse.Namespace, attest: str, round_: int) -> dict:
    side = argparse.Namespace(**{**vars(args), "attest": attest, "out": args.out / f"round{round_}_{attest}"})
    side.out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).with_name("engine_steps.py")), *step_argv(side), "--warmup", str(args.warmup)]
    with open(side.out / "run.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=vllm_child_env())
    return json.loads(result_path(side).read_text())


def cost(args: argparse.Namespace) -> dict:
    rounds = []
    for round_ in range(1, args.rounds + 1):
        order = ("on", "off") if round_ % 2 else ("off", "on")
        runs = {attest: cost_run(args, attest, round_) for attest in order}
        measured = runs["on"]["steps"][args.warmup:]
        rounds.append({
            "order": list(order),
            "step_s": {attest: run["wall_steps_s"] for attest, run in runs.items()},
            "attest_share": [step["time/attest"] / step["time/step"] for step in measured],
            "attest_s": [step["time/attest"] for step in measured],
            "canary_diff_mean": [step["attest/canary_diff_mean"] for step in measured],
            "canary_diff_max": [step["attest/canary_diff_max"] for step in measured],
            "passed": [step["attest/passed"] for step in measured],
        })
        print(json.dumps(rounds[-1]), flush=True)
    ratios = [spread(r["step_s"]["on"])["median"] / spread(r["step_s"]["off"])["median"] for r in rounds]
    every = lambda key: [value for r in rounds for value in r[key]]  # noqa: E731
    return {
        "step_time_on_over_off": spread(ratios),
        "step_s_on": spread(v for r in rounds for v in r["step_s"]["on"]),
        "step_s_off": spread(v for r in rounds for v in r["step_s"]["off"]),
        "attest_share_of_step": spread(every("attest_share")),
        "attest_s": spread(every("attest_s")),
        "canary_diff_mean": spread(every("canary_diff_mean")),
        "canary_diff_max": spread(every("canary_diff_max")),
        "all_passed": all(every("passed")),
        "rounds": rounds,
    }


def fault_child(args: argparse.Namespace) -> None:
    """In the child: three steps, the second's sync garbled once, the third's load garbled twice."""
    from trellis.engine.faults import FAULT_FILE
    from trellis.engine.rollout.backends.base import SamplingParams
    from trellis.engine.run.local import LocalRun
    from trellis.engine.weights.attestation import CORRUPT_APPLIED, CORRUPT_RECEIVED, UnattestedWeightsError, WeightAttestationError

    marker = args.out / "fault"
    os.environ[FAULT_FILE] = str(marker)
    config = step_config(Path("/tmp/trellis-gpu"), argparse.Namespace(**{**vars(args), "attest": "on", "steps": 3}))
    found: dict = {}
    with LocalRun(config, track=False) as run:
        found["step1"] = {k: v for k, v in run.train_step().metrics.items() if k.startswith("attest/")}
        marker.write_text(f"{CORRUPT_RECEIVED} 0 1")
        found["step2_bytes_flipped_once"] = {k: v for k, v in run.train_step().metrics.items() if k.startswith("attest/")}
        marker.write_text(f"{CORRUPT_APPLIED} 0 2")
        try:
            run.train_step()
            found["step3_loaded_flipped_twice"] = "NOT CAUGHT"
        except WeightAttestationError as error:
            found["step3_loaded_flipped_twice"] = str(error)
        try:
            run.workers.backend.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0.0))
            found["generate_after"] = "GENERATED"
        except UnattestedWeightsError as error:
            found["generate_after"] = f"refused: {error}"
    (args.out / "faults.json").write_text(json.dumps(found, indent=1))
    print(json.dumps(found, indent=1), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_step_arguments(parser, steps=6, backend="vllm")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (on, off), the order swapped every round")
    parser.add_argument("--faults", action="store_true", help="also the garbled-sync run")
    parser.add_argument("--fault-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.fault_child:
        fault_child(args)
        os._exit(0)  # vLLM's engine threads would hold the process open
    started = time.perf_counter()
    result = {"workload": f"engine_steps.py {' '.join(step_argv(args))}, {args.warmup} warm-up steps a run, {args.rounds} alternated rounds"}
    if args.rounds:
        result["cost"] = cost(args)
        print("step time, attestation on / off, per round:", with_spread(
            spread_s["median"] for spread_s in [result["cost"]["step_time_on_over_off"]]), flush=True)
    if args.faults:
        command = [sys.executable, __file__, *step_argv(args), "--fault-child"]
        with open(args.out / "faults.log", "w") as log:
            subprocess.run(command, check=False, stdout=log, stderr=subprocess.STDOUT, env=vllm_child_env(), timeout=300)
        faults = args.out / "faults.json"
        result["faults"] = json.loads(faults.read_text()) if faults.exists() else "no result: see faults.log"
    result["wall_s"] = time.perf_counter() - started
    (args.out / "attest_steps.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "cost"} | {"cost": {k: v for k, v in result.get("cost", {}).items() if k != "rounds"}}, indent=1))


if __name__ == "__main__":
    main()
