"""Follow a run's metrics.jsonl and show it on a progress bar (the flow runs in the main thread)."""

from __future__ import annotations

import json
import threading

import fsspec


def follow_metrics(config, bar, done: threading.Event, every_s: float = 0.5) -> None:
    uri = f"{config.run_uri}/logs/metrics.jsonl"
    seen: set[int] = set()
    while True:
        finished = done.wait(every_s)
        try:
            with fsspec.open(uri, "r", **config.storage_options) as handle:
                records = [json.loads(line) for line in handle.read().splitlines()]
        except FileNotFoundError:
            records = []
        for record in records:
            step = record["step"]
            if step in seen:
                continue
            seen.add(step)
            if "eval/accuracy" in record:
                bar.write(f"{'initial' if step == 0 else f'step {step}:'} eval accuracy {record['eval/accuracy']:.3f}")
            if step > 0:
                bar.n = max(bar.n, step)
                bar.set_postfix(reward=f"{record['response/rewards/mean']:.3f}", refresh=False)
        bar.refresh()
        if finished:
            return
