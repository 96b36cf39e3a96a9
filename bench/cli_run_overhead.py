"""What a short `trellis train` costs around its steps: the same one-step run of the bundled tiny task,
launched as a user launches it, by two trellis installs (this checkout's and a baseline's), alternately.

Each install gets a persistent local cluster of its own (`trellis cluster up`, its own home and port:
a cluster runs the trellis that started it), started before the rounds, so every measured run attaches
to a live cluster the way a user's second run does. Per run, from the launch:

- ``first_step_s``: until the console shows the run's first line (the workers are up, the run starts);
- ``ended_s``: until the console's last line (where the run's files are): the run is over;
- ``exit_s``: until the process has exited, what a script or a test waiting on the command waits for;
- ``after_end_s``: ``exit_s - ended_s``, the process's own exit;
- ``cpu_s``: user + system seconds of the `trellis` process and the children it waited for (not the
  cluster's workers, which outlive it).

    python bench/cli_run_overhead.py OUT_JSON --baseline /path/to/other/.venv/bin/trellis [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compare import run_sides  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("first_step_s", "ended_s", "exit_s", "after_end_s", "cpu_s")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(side: dict, round_: int) -> dict:
    trellis, home, work = side["trellis"], side["home"], side["work"]
    command = [trellis, "train", str(ROOT / "configs" / "tiny_reverse.yaml"), "--set", f"cluster.home={home}",
               "--set", "total_train_steps=1", "--set", f"work_dir={work}", "--set", f"experiment_name=r{round_}",
               "--set", "auto_resume=false", "--set", f"load_from={side['model']}",
               "--set", f"train_dataset.path={side['data']}/train.parquet", "--set", f"eval_dataset.path={side['data']}/eval.parquet"]
    cpu_before, started = children_cpu(), time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=side["env"], cwd=side["cwd"])
    first = ended = None
    lines = []
    for line in process.stdout:  # tqdm's bar goes to stdout too; its redraws are not lines
        lines.append(line)
        now = time.perf_counter() - started
        if first is None and "a fresh start" in line:
            first = now
        if line.startswith("tensorboard:") or line.startswith("run log:"):
            ended = now
    code = process.wait()
    exited = time.perf_counter() - started
    if code != 0 or first is None or ended is None:
        raise SystemExit(f"the run failed (exit code {code}):\n{''.join(lines)[-3000:]}")
    return {"first_step_s": first, "ended_s": ended, "exit_s": exited, "after_end_s": exited - ended,
            "cpu_s": children_cpu() - cpu_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--baseline", required=True, help="the `trellis` command of the install to compare with")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    this = str(Path(sys.executable).with_name("trellis"))
    work = Path(tempfile.mkdtemp(prefix="trellis-cli-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PREFECT_API_URL"))}
    subprocess.run([this, "tiny-model", str(work / "model"), "--data", str(work / "data")], check=True, env=env,
                   capture_output=True, cwd=work)
    sides = {}
    for name, trellis in (("baseline", args.baseline), ("this", this)):
        home, cwd = work / f"home-{name}", work / f"launch-{name}"  # a neutral folder: no checkout's packages on sys.path
        cwd.mkdir()
        side_env = {**env, "PREFECT_HOME": str(work / f"prefect-{name}")}
        subprocess.run([trellis, "cluster", "up", "--home", str(home), "--port", str(free_port()), "--num-cpus", "2"],
                       check=True, env=side_env, capture_output=True, cwd=cwd)
        sides[name] = {"trellis": trellis, "home": home, "cwd": cwd, "work": work / f"runs-{name}", "env": side_env,
                       "model": work / "model", "data": work / "data"}
    try:
        one_run(sides["baseline"], 0)  # each cluster's first run starts its workers' environment: not measured
        one_run(sides["this"], 0)
        summary = run_sides(sides, args.rounds, one_run, FIGURES)
    finally:
        for side in sides.values():
            subprocess.run([side["trellis"], "cluster", "down", "--home", str(side["home"])], env=side["env"], capture_output=True, cwd=side["cwd"])
    summary["sides"] = {name: side["trellis"] for name, side in sides.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
