"""Follow a run's records and show them on a progress bar while the flow runs in the main thread:
the total from ``logs/run_plan.json`` (written once the run knows where it starts), the steps and
rewards from ``logs/metrics.jsonl``, and above the bar what the run log says a user must know
(skipped dataset rows, failed samples, retries, worker errors)."""

from __future__ import annotations

import threading

from trellis.engine.storage.json_lines import whole_json, whole_lines
from trellis.engine.storage.store import Store


def _read(source: Store) -> str | None:
    try:
        with source.open("r") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


class RunLogTail:
    """The console lines of the run log written since this object was made; ``errors_shown`` counts
    its ERROR lines (a failure the run recorded, which the console need not repeat)."""

    def __init__(self, config) -> None:
        from trellis.engine.run.run_log import run_log_uri

        self._log = Store(run_log_uri(config.log_uri), config.storage_options)
        self._seen = len(_read(self._log) or "")
        self.errors_shown = 0

    def new_lines(self) -> list[str]:
        from trellis.engine.run.run_log import console_lines, error_lines

        text = _read(self._log) or ""
        fresh, self._seen = text[self._seen :], len(text)
        self.errors_shown += len(error_lines(fresh))
        return console_lines(fresh)


def follow_metrics(config, bar, done: threading.Event, tail: RunLogTail, every_s: float = 0.5) -> None:
    """Until ``done``: the run log's console lines above the bar, the plan's total and the steps' rewards
    on it. The files are read as their writers write them (a retried run rewrites its plan), so what is
    not yet whole is read again at the next tick."""
    from trellis.engine.run.plan import run_plan_uri

    logs = f"{config.run_uri}/logs"
    seen: set[int] = set()
    plan_text = None
    while True:
        finished = done.wait(every_s)
        for line in tail.new_lines():
            bar.write(line)
        latest = _read(Store(run_plan_uri(config), config.storage_options))
        plan = whole_json(latest) if latest != plan_text else None  # a resumed run's earlier plan is replaced soon
        if plan is not None:
            plan_text = latest
            bar.total = plan["total_steps"]
            bar.n = max(bar.n, plan["start"]["step"])
        try:
            records = whole_lines(_read(Store(f"{logs}/metrics.jsonl", config.storage_options)), source="metrics.jsonl")
        except ValueError:  # a damaged line: the bar goes on with what it showed; `trellis report` says where
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
