"""How fast one core runs the same Python loop, core by core and over time: a host-bound loop (vLLM's
engine steps) inherits whatever this shows.

Pins itself to each CPU in turn (3 passes) and times a fixed dict-heavy loop there, then 30 times unpinned,
0.1 s apart; prints one JSON line (milliseconds).

    python bench/gpu/core_speed.py
"""

from __future__ import annotations

import json
import os
import time


def work() -> dict:
    counts: dict[int, int] = {}
    for i in range(200_000):
        counts[i % 1000] = counts.get(i % 1000, 0) + i
    return counts


def timed_ms() -> float:
    started = time.perf_counter()
    work()
    return round(1e3 * (time.perf_counter() - started), 1)


def main() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    per_cpu: dict[int, list[float]] = {}
    for _ in range(3):
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            timed_ms()  # the first pass on a core warms its caches
            per_cpu.setdefault(cpu, []).append(timed_ms())
    os.sched_setaffinity(0, cpus)
    unpinned = []
    for _ in range(30):
        unpinned.append(timed_ms())
        time.sleep(0.1)
    print(json.dumps({"cpus": os.cpu_count(), "per_cpu_ms": per_cpu, "unpinned_ms": unpinned}))


if __name__ == "__main__":
    main()
