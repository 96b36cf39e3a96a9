"""Where a vLLM rollout's host time goes, measured inside the process that steps the engine.

The rollout is host-bound (the GPU is busy 31-43% of it: bench/RESULTS.md section 1), and its time for
the same 65,536 tokens has ranged 1.3-3.5 s from step to step and lease to lease. ``install`` wraps one
``VllmRollout``'s ``stream`` and its engine's ``step`` and records, for every ``stream`` call:

- wall seconds, engine steps, and each engine step's wall time (median, p90, max, sum);
- the stepping thread's CPU seconds inside the engine steps, and over the call; the whole process's;
- the stepping thread's voluntary and involuntary context switches (waits, and preemptions by others);
- Python's garbage collections during the call (count, seconds, longest) by generation;
- the host's CPU busy fraction over the call, and the processes that used the most CPU in it.

A thread that waits (on the GPU, or the GIL) shows wall well above CPU; one preempted by other processes
shows involuntary switches and a busy host; a slower host loop shows CPU seconds per step going up.
What the probe adds to a rollout: a timer call per engine step, and a scan of the process table at each
end of the call (3 ms for 75 processes here; more on a busier host), outside the engine steps.

Used by ``engine_steps.py --probe-rollout`` (the in-process step) and ``flow_steps.py --probe-rollout``
(the rollout actor of the flow, reached through its ``call``).
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import statistics
import subprocess
import time
from datetime import datetime
from typing import Any

import psutil


def install(backend: Any) -> dict:
    """Wraps ``backend`` (a ``VllmRollout``) once; what the process looks like now."""
    if getattr(backend, "_host_probe", None) is None:
        backend._host_probe = _Probe(backend)
    return {
        "pid": os.getpid(),
        "torch_threads": _torch_threads(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "gc_frozen_objects": gc.get_freeze_count(),
        "gc_tracked_objects": len(gc.get_objects()),
        "gc_thresholds": gc.get_threshold(),
        "threads": psutil.Process().num_threads(),
    }


def records(backend: Any) -> list[dict]:
    """Every ``stream`` call's record since ``install``, and forgets them."""
    probe = backend._host_probe
    taken, probe.calls = probe.calls, []
    return taken


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class _Probe:
    def __init__(self, backend: Any) -> None:
        self.calls: list[dict] = []
        self._open: dict | None = None
        self._gc_started = 0.0
        stream = backend.stream

        def timed_step():
            wall, cpu = time.perf_counter(), time.thread_time()
            outputs = engine_step()
            if self._open is not None:
                self._open["step_wall"].append(time.perf_counter() - wall)
                self._open["step_cpu_s"] += time.thread_time() - cpu
            return outputs

        def timed_stream(*args, **kwargs):
            self._open = self._start()
            try:
                yield from stream(*args, **kwargs)
            finally:
                self.calls.append(self._finish(self._open))
                self._open = None

        llm = getattr(backend, "_llm", None)  # vLLM's; the transformers backend has no engine steps to time
        if llm is not None:
            engine_step = llm.llm_engine.step
            llm.llm_engine.step = timed_step
        backend.stream = timed_stream
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        record = self._open
        if record is not None:
            took = time.perf_counter() - self._gc_started
            entry = record["gc"].setdefault(str(info["generation"]), {"count": 0, "seconds": 0.0, "longest_s": 0.0})
            entry["count"] += 1
            entry["seconds"] += took
            entry["longest_s"] = max(entry["longest_s"], took)

    def _start(self) -> dict:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return {
            "started_at": time.time(), "wall0": time.perf_counter(), "thread_cpu0": time.thread_time(),
            "process_cpu0": time.process_time(), "voluntary0": usage.ru_nvcsw, "involuntary0": usage.ru_nivcsw,
            "host0": psutil.cpu_times(), "processes0": _process_cpu(), "step_wall": [], "step_cpu_s": 0.0, "gc": {},
        }

    def _finish(self, record: dict) -> dict:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        wall = time.perf_counter() - record["wall0"]
        steps = sorted(record["step_wall"])
        host = psutil.cpu_times()
        host_total = sum(host) - sum(record["host0"])
        host_idle = (host.idle + host.iowait) - (record["host0"].idle + record["host0"].iowait)
        used = _process_cpu()
        top = sorted(((used[key] - record["processes0"].get(key, 0.0), key[1]) for key in used), reverse=True)[:6]
        return {
            "started_at": record["started_at"],
            "wall_s": wall,
            "engine_steps": len(steps),
            "step_wall_sum_s": sum(steps),
            "step_wall_median_ms": 1e3 * statistics.median(steps) if steps else 0.0,
            "step_wall_p90_ms": 1e3 * steps[int(0.9 * (len(steps) - 1))] if steps else 0.0,
            "step_wall_max_ms": 1e3 * steps[-1] if steps else 0.0,
            "steps_over_20ms": sum(1 for s in steps if s > 0.020),
            "step_thread_cpu_s": record["step_cpu_s"],
            "thread_cpu_s": time.thread_time() - record["thread_cpu0"],
            "process_cpu_s": time.process_time() - record["process_cpu0"],
            "voluntary_switches": usage.ru_nvcsw - record["voluntary0"],
            "involuntary_switches": usage.ru_nivcsw - record["involuntary0"],
            "gc": record["gc"],
            "host_cpus": psutil.cpu_count(),
            "host_busy_fraction": 1 - host_idle / host_total if host_total > 0 else 0.0,
            "top_processes_cpu_s": [[name, round(seconds, 3)] for seconds, name in top],
        }


def _process_cpu() -> dict[tuple[int, str], float]:
    """Every process's CPU seconds so far, keyed by (pid, name)."""
    seconds = {}
    for process in psutil.process_iter(["pid", "name", "cpu_times"]):
        times = process.info["cpu_times"]
        if times is not None:
            seconds[(process.info["pid"], process.info["name"] or "?")] = times.user + times.system
    return seconds


def sample_gpu_busy(path) -> subprocess.Popen | None:
    """nvidia-smi's GPU utilization every 100 ms into ``path`` (timestamped), until terminated; None
    where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu", "--format=csv,noheader,nounits",
                             "-lms", "100", "-f", str(path)])


def read_gpu_busy(path) -> list[tuple[float, float]]:
    """(epoch seconds, percent busy) samples that ``sample_gpu_busy`` wrote (the host's local time)."""
    samples = []
    if not os.path.exists(path):
        return samples
    for line in open(path):
        stamp, _, busy = line.strip().rpartition(",")
        try:
            samples.append((datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(busy)))
        except ValueError:
            continue
    return samples


def with_gpu_busy(probed: dict, samples: list[tuple[float, float]]) -> dict:
    """``probed`` ({"process", "calls"}) with each call's mean GPU busy percent over its wall time."""
    calls = []
    for call in probed["calls"] or []:
        inside = [busy for at, busy in samples if call["started_at"] <= at <= call["started_at"] + call["wall_s"]]
        calls.append({**call, "gpu_busy_percent": statistics.mean(inside) if inside else None, "gpu_samples": len(inside)})
    return {**probed, "calls": calls}
