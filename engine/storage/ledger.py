"""The per-prompt ledger: one row for every group a training step took (its prompt's epoch and index,
the policy versions that generated it, the step that trained it, whether it was trained or left out
for a failed sample), under ``{run}/ledger/step=NNNNNN/part-0.parquet``.

A step's part is replaced when the step is done again after a resume, so the ledger describes the
run as it stands, and one query shows that every prompt of an epoch was trained exactly once
(``EXACTLY_ONCE``: it returns no rows).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from engine.data.samples import RolloutSample, Status
from engine.storage.lake import write_part

SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("train_step", pa.int64()),
        ("epoch", pa.int64()),
        ("prompt_index", pa.int64()),
        ("group_id", pa.string()),
        ("samples", pa.int32()),
        ("oldest_version", pa.int64()),
        ("newest_version", pa.int64()),
        ("status", pa.string()),  # trained, or failed (a sample's reward failed: the group is left out)
    ]
)

# DuckDB over a run folder: prompts taken by no step or by several ({run} and {epoch} filled in).
EXACTLY_ONCE = (
    "SELECT epoch, prompt_index, count(*) AS times FROM read_parquet('{run}/ledger/*/*.parquet') "
    "WHERE epoch = {epoch} GROUP BY epoch, prompt_index HAVING count(*) != 1"
)


def ledger_uri(run_uri: str, step: int) -> str:
    return f"{run_uri.rstrip('/')}/ledger/step={step:06d}"


def ledger_row(group: list[RolloutSample], run: str, step: int) -> dict[str, Any]:
    versions = [v for sample in group for v in (sample.response_versions or [sample.policy_version])]
    return {
        "run": run,
        "train_step": step,
        "epoch": group[0].epoch,
        "prompt_index": group[0].prompt_index,
        "group_id": group[0].group_id,
        "samples": len(group),
        "oldest_version": min(versions),
        "newest_version": max(versions),
        "status": "failed" if any(sample.status == Status.FAILED for sample in group) else "trained",
    }


def write_ledger(
    groups: list[list[RolloutSample]], *, run_uri: str, run: str, step: int, storage_options: dict[str, Any] | None = None
) -> str:
    table = pa.Table.from_pylist([ledger_row(group, run, step) for group in groups], schema=SCHEMA)
    return write_part(table, ledger_uri(run_uri, step), storage_options)
