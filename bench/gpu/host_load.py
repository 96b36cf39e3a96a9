"""What else a GPU host runs as a contestant starts: its load, and the busy processes older than this
bench, which an earlier call on the same warm machine left behind.

In one lease, trellis's steps took 2.38, 3.13 and 3.56 s in three calls back to back, every phase
slower (the rollout 1.37 -> 1.84 s, the weight sync 0.12 -> 0.18 s), while TRL's took 4.80, 4.63 and
4.59 s (bench/results/h100_sleep_auto_2026-12-06). trellis runs several processes (Ray, Prefect, vLLM's
engine core) and TRL one; what each contestant found on the host tells whether CPUs were shared."""

from __future__ import annotations

import os
import subprocess
import time

BENCH_STARTED = time.time()
BUSY_PERCENT = 1.0  # ps's %CPU: CPU time over the process's whole life


def host_load(top: int = 5) -> dict:
    load_1min, load_5min, _ = os.getloadavg()
    bench_age = time.time() - BENCH_STARTED
    try:
        lines = subprocess.run(["ps", "-eo", "etimes=,pcpu=,rss=,comm="], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        lines = []
    older = []
    for line in lines:
        fields = line.split(None, 3)
        if len(fields) == 4 and float(fields[0]) > bench_age + 5 and float(fields[1]) >= BUSY_PERCENT:
            older.append({"age_s": int(fields[0]), "cpu_percent": float(fields[1]), "rss_mib": int(fields[2]) // 1024, "command": fields[3]})
    older.sort(key=lambda process: -process["cpu_percent"])
    return {"load_1min": round(load_1min, 2), "load_5min": round(load_5min, 2), "cpus": os.cpu_count(), "older_busy_processes": older[:top]}


def describe(load: dict) -> str:
    processes = ", ".join(f"{p['command']} ({p['cpu_percent']:.0f}%, {p['age_s']} s old)" for p in load["older_busy_processes"])
    return f"host load {load['load_1min']} (1 min) on {load['cpus']} CPUs; busy processes older than this bench: {processes or 'none'}"
