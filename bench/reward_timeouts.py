"""What hung reward calls cost a batch: 128 samples, ``--hung`` of which sleep forever, timeout
``--timeout`` s, one scoring worker. The peer is the pool trellis used before (pebble's, each call
scheduled with its timeout up front), in the same run; the figure is the wall time of one batch.
Then what a user waits on: two in-process training steps of the tiny task (build/tiny) whose reward
function hangs on about 1 sample in 25, and their ``time/produce_batch`` and ``time/step``.

    .venv/bin/python bench/reward_timeouts.py [--hung 5] [--timeout 5] [--out bench/results/reward_timeouts.json]
"""

from __future__ import annotations

import json
import multiprocessing
import time
import zlib
from pathlib import Path

import typer
from pebble import ProcessPool

from trellis.engine.config import RewardConfig
from trellis.engine.rollout.rewards.runner import RewardRunner, call_reward


def hangs_on_one_in_25(sample):
    if zlib.crc32(f"{sample['label']}|{sample['response']}".encode()) % 25 == 0:
        time.sleep(3600)
    return 1.0 if sample["response"].strip() == sample["label"] else 0.0


def hangs_on_h(sample):
    if sample["response"] == "h":
        time.sleep(3600)
    return 1.0 if sample["response"] == sample["label"] else 0.0


SPEC = f"{Path(__file__).resolve()}:hangs_on_h"


def batch(hung: int, size: int = 128) -> list[dict]:
    responses = ["a"] * (size - hung) + ["h"] * hung
    responses = responses[::2] + responses[1::2]
    return [{"response": r, "label": "a", "prompt": [], "data_source": "d", "task_name": "t"} for r in responses]


def plain_pool_s(samples: list[dict], timeout_s: float) -> float:
    pool = ProcessPool(max_workers=1, context=multiprocessing.get_context("fork"))
    try:
        started = time.perf_counter()
        futures = [pool.schedule(call_reward, args=(SPEC, sample), timeout=timeout_s) for sample in samples]
        for future in futures:
            try:
                future.result()
            except Exception:
                pass
        return time.perf_counter() - started
    finally:
        pool.stop()
        pool.join(timeout=5)


def trellis_s(samples: list[dict], timeout_s: float) -> float:
    with RewardRunner(RewardConfig(function=SPEC, timeout_s=timeout_s, num_workers=1)) as runner:
        runner.score(batch(0, 4))  # workers up, function imported: as in a run's later steps
        started = time.perf_counter()
        runner.score(samples)
        return time.perf_counter() - started


def training_steps(timeout_s: float) -> list[dict]:
    from trellis.engine.config.loading import load_config
    from trellis.engine.run.local import LocalRun

    root = Path(__file__).resolve().parents[1]
    config = load_config(
        root / "configs" / "tiny_reverse.yaml", total_train_steps=2, enable_evaluate=False, enable_initial_evaluate=False,
        checkpoint_interval=-1, hf_interval=-1, auto_resume=False,
        reward={"function": f"{Path(__file__).resolve()}:hangs_on_one_in_25", "timeout_s": timeout_s},
    )
    with LocalRun(config, track=False) as run:
        reports = run.run()
    return [
        {"step": r.step, "hung_samples": r.metrics["rollout/failed_samples"], "produce_batch_s": round(r.metrics["time/produce_batch"], 2),
         "step_s": round(r.metrics["time/step"], 2)}
        for r in reports
    ]


def main(hung: int = 5, timeout: float = 5.0, out: Path = Path("bench/results/reward_timeouts.json")) -> None:
    figures = {"samples": 128, "hung": hung, "timeout_s": timeout}
    for label, count in (("with_hung_calls", hung), ("no_hung_calls", 0)):
        samples = batch(count)
        peer, ours = plain_pool_s(samples, timeout), trellis_s(samples, timeout)
        figures[label] = {"plain_pool_s": round(peer, 2), "trellis_s": round(ours, 2), "speedup": round(peer / ours, 2)}
        typer.echo(f"{label}: plain pool {peer:.2f} s, trellis {ours:.2f} s ({peer / ours:.1f}x)")
    figures["training_steps"] = training_steps(timeout)
    typer.echo(f"training steps: {figures['training_steps']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
