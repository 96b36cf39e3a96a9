"""What Prefect alone costs a step: a parent flow runs ``--steps`` child flow runs (as ``rl_run`` runs
``rl_step``), each with N tasks that sleep ``--work`` seconds (no CPU), on a temporary server with
trellis's lean settings and the step flow's options (no heartbeats, no result persistence, no parameter
validation). No Ray, no model: what a step takes beyond N x work is orchestration, the floor that
Prefect puts under a flow step on this machine.

N alternates over ``--tasks`` (default 0, 3, 6; trellis's colocated CPU step runs 6 tasks) for
``--rounds`` rounds; each figure is the median over the rounds of the overhead per step (wall time
between consecutive child flow starts minus N x work), with min..max, and the CPU seconds a step
costs this process and the server (psutil).

Tasks that do nothing (``--work 0``) make steps of ~0.1 s, and then the server's SQLite refuses the
next step's subflow task run ("database is locked" while it records the last step's task-run events,
PrefectHQ/prefect#18934) and the client retries after ~2 s: real steps are long enough not to meet it
(0 of 30 trellis flow steps on 2 cores at aad62b6).

    .venv/bin/python bench/prefect_floor.py [--steps 30] [--rounds 2] [--tasks 0,3,6] [--work 0.03]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _measure
from trellis.flows.prefect_settings import step_loop_settings, use_lean_temporary_server  # noqa: E402

use_lean_temporary_server()

import typer  # noqa: E402
from _measure import StepClock  # noqa: E402
from prefect import flow, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.settings import temporary_settings  # noqa: E402

WARMUP = 3


@task(name="phase", task_run_name="phase[step={step}]", cache_policy=NO_CACHE, persist_result=False)
def phase(step: int, work_s: float) -> float:
    time.sleep(work_s)
    return work_s


@flow(name="step", flow_run_name="step[step={step}]", persist_result=False, validate_parameters=False)
def step_flow(step: int, tasks: int, work_s: float, parameters: dict) -> float:
    return sum(phase(step, work_s) for _ in range(tasks))


@flow(name="run", persist_result=False)
def run_flow(steps: int, tasks: int, work_s: float, parameters: dict) -> list[float]:
    starts = []
    with temporary_settings(step_loop_settings()):  # as rl_run calls its steps
        for step in range(steps):
            starts.append(time.perf_counter())
            step_flow(step, tasks, work_s, parameters)
        starts.append(time.perf_counter())
    return [b - a for a, b in zip(starts, starts[1:])]


def main(steps: int = 30, rounds: int = 2, tasks: str = "0,3,6", work: float = 0.03) -> None:
    counts = [int(n) for n in tasks.split(",")]
    # A config-sized parameter, as rl_step receives the run's config.
    parameters = {f"key_{i}": {"value": i, "name": f"setting {i}"} for i in range(200)}
    run_flow(2, 1, work, parameters)  # starts the temporary server
    clock = StepClock()  # CPU of this process and its children: the temporary server is one
    overheads: dict[int, list[float]] = {n: [] for n in counts}
    cpus: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            clock.start()
            intervals = run_flow(steps + WARMUP, n, work, parameters)[WARMUP:]
            clock.stop()
            cpus[n].append(clock.cpu[-1] / (steps + WARMUP))
            overheads[n] += [wall - n * work for wall in intervals]
    print(f"{'tasks':>5}  {'overhead s/step: median (min..max, n)':40}  CPU-s/step (this process + server)")
    for n in counts:
        o = overheads[n]
        print(f"{n:>5}  {statistics.median(o):.4f} ({min(o):.4f}..{max(o):.4f}, n={len(o)})           {statistics.median(cpus[n]):.4f}")
    if len(counts) > 1 and counts[0] == 0:
        last = counts[-1]
        per_task = (statistics.median(overheads[last]) - statistics.median(overheads[0])) / last
        print(f"per task run: {per_task * 1000:.1f} ms; flow run alone: {statistics.median(overheads[0]) * 1000:.1f} ms")


if __name__ == "__main__":
    typer.run(main)
