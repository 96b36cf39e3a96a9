"""What a GPU host runs and how fast its cores are, around each contestant of a comparing bench
(``clean_host``): what earlier contestants or calls left running is ended first, the host's load and its
older busy processes are recorded, and while the contestant runs a thread times one fixed Python loop.

Why: in one lease, trellis's steps took 2.38, 3.13 and 3.56 s in three calls back to back (every phase
slower) while TRL's held at 4.6-4.8 s (bench/results/h100_sleep_auto_2026-12-06), and trellis's rollout
is one host-bound thread whose speed follows the vCPU's (bench/RESULTS.md section 1). The next lease
found no leftovers, and trellis's rollout moved with the loop's time (section 3)."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from core_speed import timed_ms

BENCH_STARTED = time.time()
BUSY_PERCENT = 1.0  # ps's %CPU: CPU time over the process's whole life


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def host_load(top: int = 5) -> dict:
    load_1min, load_5min, _ = os.getloadavg()
    bench_age = time.time() - BENCH_STARTED
    try:
        lines = subprocess.run(["ps", "-eo", "pid=,etimes=,pcpu=,rss=,comm="], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        lines = []
    older, mine = [], _ancestors()
    for line in lines:
        fields = line.split(None, 4)
        if len(fields) == 5 and int(fields[0]) not in mine and float(fields[1]) > bench_age + 5 and float(fields[2]) >= BUSY_PERCENT:
            older.append({"age_s": int(fields[1]), "cpu_percent": float(fields[2]), "rss_mib": int(fields[3]) // 1024, "command": fields[4]})
    older.sort(key=lambda process: -process["cpu_percent"])
    return {"load_1min": round(load_1min, 2), "load_5min": round(load_5min, 2), "cpus": os.cpu_count(), "older_busy_processes": older[:top]}


def describe(load: dict) -> str:
    processes = ", ".join(f"{p['command']} ({p['cpu_percent']:.0f}%, {p['age_s']} s old)" for p in load["older_busy_processes"])
    return f"host load {load['load_1min']} (1 min) on {load['cpus']} CPUs; busy processes older than this bench: {processes or 'none'}"


LEFTOVER_NAMES = ("raylet", "gcs_server", "ray::", "ray/_private", "ray/dashboard", "EngineCore", "prefect.server")


def leftover_processes() -> list[dict]:
    """Processes of an earlier contestant that outlived it (Ray's daemons and workers, vLLM's engine
    core, a Prefect server): before a contestant starts, none of them should run."""
    try:
        lines = subprocess.run(["ps", "-eo", "pid=,etimes=,pcpu=,args="], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return []
    found, mine = [], _ancestors()
    for line in lines:
        fields = line.split(None, 3)
        if len(fields) == 4 and int(fields[0]) not in mine and any(name in fields[3] for name in LEFTOVER_NAMES):
            found.append({"pid": int(fields[0]), "age_s": int(fields[1]), "cpu_percent": float(fields[2]), "command": fields[3][:120]})
    return found


def end_leftovers() -> list[dict]:
    """Kill ``leftover_processes`` and say which they were, so that no contestant shares the host's CPUs
    with what an earlier one left running."""
    found = leftover_processes()
    for process in found:
        try:
            os.kill(process["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    if found:
        time.sleep(1.0)
    return found


class CoreSpeed:
    """The milliseconds one fixed Python loop takes (``core_speed.work``), timed once a second on a thread
    while a contestant runs: a host-bound rollout inherits whatever speed the host's vCPUs show meanwhile
    (bench/RESULTS.md section 1). The loop takes ~2-5% of one vCPU."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.samples_ms: list[float] = []
        self._every_s, self._done = every_s, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> CoreSpeed:
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(self._every_s):
            self.samples_ms.append(timed_ms())

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join()

    def summary(self) -> dict | None:
        if not self.samples_ms:
            return None
        ordered = sorted(self.samples_ms)
        return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def add_end_leftovers_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--end-leftovers", action="store_true",
                        help="kill what earlier contestants or calls left running (Ray, vLLM's engine core, a Prefect server) before "
                             "each contestant: for a lent GPU machine, not one whose own cluster or server would match")


@contextmanager
def clean_host(label: str, *, end_leftovers_first: bool = False) -> Iterator[dict]:
    """Around one contestant of a comparing bench: first list what earlier contestants (or calls) left
    running, and with ``end_leftovers_first`` end it (a lent GPU machine; never a machine whose own Ray
    cluster or Prefect server would match), and print the host's load; meanwhile time the host's core
    speed. The dict it yields gets ``host_before``, ``leftovers`` (with ``leftovers_ended``),
    ``core_loop_ms`` and ``core_loop_ms_median`` when the block ends, also when it raises: merge them into
    the contestant's record."""
    found = end_leftovers() if end_leftovers_first else leftover_processes()
    host = host_load()
    print(f"{label}: {describe(host)}; {'ended' if end_leftovers_first else 'found'} {len(found)} leftover processes"
          + "".join(f"\n  {p['command']} ({p['age_s']} s old, {p['cpu_percent']:.0f}% CPU)" for p in found), flush=True)
    witness: dict = {}
    speed = CoreSpeed()
    try:
        with speed:
            yield witness
    finally:
        core = speed.summary()
        witness.update(host_before=host, leftovers=found, leftovers_ended=end_leftovers_first, core_loop_ms=core,
                       core_loop_ms_median=(core or {}).get("median"))
