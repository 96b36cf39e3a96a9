"""Follow a run's records and show them on a progress bar while the flow runs in the main thread:
the total from ``logs/run_plan.json`` (written once the run knows where it starts), the steps and
rewards from ``logs/metrics.jsonl``."""

from __future__ import annotations

import json
import threading

import fsspec


def _read(uri: str, storage_options: dict) -> str | None:
    try:
        with fsspec.open(uri, "r", **storage_options) as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def follow_metrics(config, bar, done: threading.Event, every_s: float = 0.5) -> None:
    from engine.run.plan import run_plan_uri

    logs = f"{config.run_uri}/logs"
    seen: set[int] = set()
    plan_text = None
    while True:
        finished = done.wait(every_s)
        latest = _read(run_plan_uri(config), config.storage_options)
        if latest is not None and latest != plan_text:  # a resumed run's earlier plan is replaced soon
            plan_text, plan = latest, json.loads(latest)
            bar.total = plan["total_steps"]
            bar.n = max(bar.n, plan["start"]["step"])
        text = _read(f"{logs}/metrics.jsonl", config.storage_options)
        for record in map(json.loads, (text or "").splitlines()):
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
