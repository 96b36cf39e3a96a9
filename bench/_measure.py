"""Per-step wall and CPU seconds of this process and its children (reward workers count too)."""

from __future__ import annotations

import json
import time

import psutil


class StepClock:
    def __init__(self) -> None:
        self._process = psutil.Process()
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._start_wall = 0.0
        self._start_cpu = 0.0

    def _cpu_now(self) -> float:
        total = sum(self._process.cpu_times()[:2])
        for child in self._process.children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return total

    def start(self) -> None:
        self._start_wall, self._start_cpu = time.perf_counter(), self._cpu_now()

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._start_wall)
        self.cpu.append(self._cpu_now() - self._start_cpu)

    def dump(self, path: str, **extra) -> None:
        with open(path, "w") as handle:
            json.dump({"wall": self.wall, "cpu": self.cpu, "peak_rss_gb": self._process.memory_info().rss / 2**30, **extra}, handle)


def busy_spans(timeline: list[dict], callers: tuple[str, ...]) -> list[tuple[float, float]]:
    """(start, end) wall seconds of every actor call named ``caller.something`` in ``ray.timeline()``, for
    the ``callers`` given (actor classes, and roles for calls named after them)."""
    spans = []
    for event in timeline:
        category = str(event.get("cat", ""))
        if event.get("ph") == "X" and category.startswith("task::") and category[6:].split(".")[0] in callers:
            start = float(event["ts"]) / 1e6
            spans.append((start, start + float(event["dur"]) / 1e6))
    return spans


def idle_seconds(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Time in [start, end) when none of the spans ran: the workers waited on the orchestrator."""
    covered, reached = 0.0, start
    for span_start, span_end in sorted(spans):
        span_start, span_end = max(span_start, reached), min(span_end, end)
        if span_end > span_start:
            covered += span_end - span_start
            reached = span_end
    return (end - start) - covered
