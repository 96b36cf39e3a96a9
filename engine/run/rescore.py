"""Score a run's stored trajectories again with another reward function, into a new lake split, and
compare: what a new verifier would have said of the same responses, without generating anything.

Rows keep everything but their reward (the old one moves to ``reward_payload.previous_reward``);
samples that never completed (aborted or failed in generation) are copied as they are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa

from trellis.engine.config import RewardConfig
from trellis.engine.data.samples import Status
from trellis.engine.parquet_reads import read_parquet
from trellis.engine.rollout.rewards.runner import RewardRunner
from trellis.engine.storage.lake import SCHEMA, LakeError, from_row, partition_uri, stored_steps, write_part
from trellis.engine.storage.store import Store

CORRECT_ABOVE = 0.5


@dataclass(frozen=True)
class StepComparison:
    step: int
    samples: int
    rescored: int
    failed: int  # the new reward function failed on these
    old_mean: float | None
    new_mean: float | None
    agreement: float | None  # share of rescored samples both functions call correct, or both wrong


@dataclass(frozen=True)
class Rescore:
    split: str
    steps: list[StepComparison]

    def table(self) -> list[dict[str, Any]]:
        return [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in vars(step).items()} for step in self.steps
        ]


def rescore_split_name(function: str) -> str:
    return "rescore-" + re.sub(r"[^A-Za-z0-9_]+", "_", function.rsplit(":", 1)[-1]).strip("_")


def rescore_run(
    run: Store,
    reward: RewardConfig,
    *,
    split: str = "train",
    steps: list[int] | None = None,
    into: str | None = None,
    flow_run_id: str | None = None,
) -> Rescore:
    run_uri, options = run.uri, run.options
    stored = stored_steps(run, split)
    if not stored:
        raise LakeError(f"{run_uri} has no stored trajectories in split={split}.")
    wanted = stored if steps is None else steps
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise LakeError(f"split={split} of {run_uri} holds no step {missing[0]}; stored steps: {_ranges(stored)}.")
    target = into or rescore_split_name(reward.function)
    if target == split:
        raise ValueError(f"Rescoring into split={split} would overwrite the trajectories it reads; name another split.")
    comparisons = []
    with RewardRunner(reward) as runner:
        for step in wanted:
            rows = _read_rows(f"{partition_uri(run_uri, split, step)}/part-0.parquet", options)
            comparisons.append(_rescore_rows(rows, runner, step, flow_run_id))
            write_part(pa.Table.from_pylist(rows, schema=SCHEMA), Store(partition_uri(run_uri, target, step), options))
    return Rescore(target, comparisons)


def _read_rows(uri: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    fs, path = fsspec.core.url_to_fs(uri, **options)
    rows = read_parquet(fs, path).to_pylist()
    for row in rows:  # partitions written before a column existed read back without it
        for name in SCHEMA.names:
            row.setdefault(name, None)
    return rows


def _rescore_rows(rows: list[dict[str, Any]], runner: RewardRunner, step: int, flow_run_id: str | None) -> StepComparison:
    scorable = [row for row in rows if row["status"] in (Status.COMPLETED.value, Status.FAILED.value) and row["response_ids"]]
    results = runner.score([from_row(row).reward_input() for row in scorable])
    old, new, agree, failed = [], [], 0, 0
    for row, result in zip(scorable, results):
        previous = row["reward"]
        payload = {**json.loads(row["reward_payload"] or "{}"), "previous_reward": previous, "previous_flow_run_id": row["flow_run_id"]}
        if result.error is not None:
            row.update(status=Status.FAILED.value, error_msg=result.error, reward=None)
            failed += 1
        else:
            row.update(status=Status.COMPLETED.value, error_msg=None, reward=result.score)
            payload.update(result.payload)
            new.append(result.score)
            if previous is not None:
                old.append(previous)
                agree += (previous > CORRECT_ABOVE) == (result.score > CORRECT_ABOVE)
        row["reward_payload"] = json.dumps(payload, default=str)
        row["flow_run_id"] = flow_run_id
    compared = len(old)
    return StepComparison(
        step=step,
        samples=len(rows),
        rescored=len(scorable) - failed,
        failed=failed,
        old_mean=sum(old) / compared if compared else None,
        new_mean=sum(new) / len(new) if new else None,
        agreement=agree / compared if compared else None,
    )


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 3 else ", ".join(map(str, steps))
