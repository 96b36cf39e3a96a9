"""The per-prompt ledger: what became of every prompt the run drew, written as three Parquet tables.

```
{run}/ledger/universe/{sampler}/epoch-NNNNNN.parquet  each epoch's prompts in the order the sampler draws them
{run}/ledger/groups/step=NNNNNN/part-0.parquet        every group the step resolved, with its status
{run}/ledger/open/step=NNNNNN/part-0.parquet          at the step: how far each sampler has drawn, and the
                                                      prompts drawn and not resolved yet (in the replay buffer)
```

A group's status is ``trained``, or why its prompt was dropped: ``failed`` (a sample's reward
failed), ``filtered`` (dynamic sampling: rewards all equal, or surplus), ``invalid`` (a sample was
aborted or came back empty), ``given_up`` (it grew too stale and ``tail_batch_trigger_size: -1``
drops such prompts), ``rolled_back`` (trained in a step the stability guard rolled back, with
``guard.skip_batches``: never trained on again); all six end the prompt. ``expired`` does not: the
group grew too stale, its responses were dropped and its prompt is generated again, so a later row
ends it.

``sampler`` is ``train_dataset`` for a one-task run and the task's name in a multi-task run (each
task has its own sampler and epochs); ``prompt_index`` is the prompt's row in that dataset.

The guarantee: every prompt a sampler has drawn is either still open or ended by exactly one row,
and none is ended twice; an epoch is finished once all its prompts are drawn and none is open.
``engine.storage.ledger_check`` (``trellis ledger check``) checks it. A step's parts are replaced
when the step runs again, and a run that starts again from a checkpoint first removes the parts of
the steps after it (``forget_after``), so the ledger describes the run as it stands.
Each epoch's universe is written when the sampler begins it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from trellis.engine.data.samples import RolloutSample
from trellis.engine.parquet_reads import read_parquet
from trellis.engine.storage.lake import write_part, write_table
from trellis.engine.storage.store import Store

ENDING = ("trained", "failed", "filtered", "invalid", "given_up", "rolled_back")
STATUSES = (*ENDING, "expired")
SINGLE_TASK = "train_dataset"  # the sampler of a run without ``tasks:``

GROUPS = pa.schema(
    [
        ("run", pa.string()),
        ("train_step", pa.int64()),  # the step that recorded the row
        ("sampler", pa.string()),
        ("epoch", pa.int64()),
        ("prompt_index", pa.int64()),
        ("group_id", pa.string()),
        ("samples", pa.int32()),
        ("oldest_version", pa.int64()),
        ("newest_version", pa.int64()),
        ("status", pa.string()),
        ("reason", pa.string()),  # why a group was dropped ("" when trained)
    ]
)
UNIVERSE = pa.schema(
    [("run", pa.string()), ("sampler", pa.string()), ("epoch", pa.int64()), ("position", pa.int64()), ("prompt_index", pa.int64())]
)
OPEN = pa.schema(
    [
        ("run", pa.string()),
        ("train_step", pa.int64()),
        ("sampler", pa.string()),
        ("kind", pa.string()),  # "drawn": the sampler has drawn `position` prompts of `epoch`; "open": a prompt not resolved yet
        ("epoch", pa.int64()),
        ("position", pa.int64()),
        ("prompt_index", pa.int64()),
        ("group_id", pa.string()),
    ]
)

# Prompts of one finished epoch that no row ended, or that several did ({run} and {epoch} filled in):
# the universe anti-joined with the rows that end a prompt. No rows back means the epoch is accounted for.
EXACTLY_ONCE = """
SELECT u.sampler, u.epoch, u.prompt_index, count(g.group_id) AS times
FROM read_parquet('{run}/ledger/universe/*/*.parquet') AS u
LEFT JOIN (SELECT * FROM read_parquet('{run}/ledger/groups/*/*.parquet') WHERE status != 'expired') AS g
  USING (sampler, epoch, prompt_index)
WHERE u.epoch = {epoch}
GROUP BY ALL HAVING count(g.group_id) != 1
ORDER BY u.sampler, u.prompt_index
"""


@dataclass(frozen=True)
class Drawn:
    """How far one sampler has drawn: every prompt of the epochs before ``epoch`` and the first
    ``position`` of ``epoch``'s order."""

    sampler: str
    epoch: int
    position: int


@dataclass
class LedgerEntries:
    """What a training step writes to the ledger besides its own batch's groups: the groups resolved
    outside the batch since the previous one (dropped by the asynchronous producer), how far each
    sampler had drawn when the batch was made, and the prompts drawn and not yet resolved then."""

    resolved: list[dict[str, Any]] = field(default_factory=list)  # group_row()s
    drawn: list[Drawn] = field(default_factory=list)
    open: list[tuple[str, int, int, str]] = field(default_factory=list)  # (sampler, epoch, prompt_index, group_id)


def group_row(group: list[RolloutSample], sampler: str, status: str, reason: str = "") -> dict[str, Any]:
    """A group's ledger row, without the run and step that record it."""
    versions = [v for sample in group for v in (sample.response_versions or [sample.policy_version])]
    first = group[0]
    return {
        "sampler": sampler,
        "epoch": first.epoch,
        "prompt_index": first.prompt_index,
        "group_id": first.group_id,
        "samples": len(group),
        "oldest_version": min(versions),
        "newest_version": max(versions),
        "status": status,
        "reason": reason,
    }


def open_entry(group: list[RolloutSample], sampler: str) -> tuple[str, int, int, str]:
    return (sampler, group[0].epoch, group[0].prompt_index, group[0].group_id)


def ledger_root(run_uri: str) -> str:
    return f"{run_uri.rstrip('/')}/ledger"


def write_step(rows: list[dict[str, Any]], entries: LedgerEntries, *, store: Store, run: str, step: int) -> None:
    """The step's resolved groups and open prompts (each part replaced when the step runs again);
    ``store``: the run's folder."""
    root = store.join("ledger")
    groups = [{"run": run, "train_step": step, **row} for row in [*rows, *entries.resolved]]
    write_part(pa.Table.from_pylist(groups, schema=GROUPS), root.join("groups", f"step={step:06d}"))
    state = [
        {"run": run, "train_step": step, "sampler": d.sampler, "kind": "drawn", "epoch": d.epoch, "position": d.position}
        for d in entries.drawn
    ] + [
        {"run": run, "train_step": step, "sampler": s, "kind": "open", "epoch": e, "prompt_index": p, "group_id": g}
        for s, e, p, g in entries.open
    ]
    write_part(pa.Table.from_pylist(state, schema=OPEN), root.join("open", f"step={step:06d}"))


def universe_uri(run_uri: str, sampler: str, epoch: int) -> str:
    return f"{ledger_root(run_uri)}/universe/{sampler}/epoch-{epoch:06d}.parquet"


def write_universe(prompt_indices: list[int], *, store: Store, run: str, sampler: str, epoch: int) -> None:
    rows = [
        {"run": run, "sampler": sampler, "epoch": epoch, "position": position, "prompt_index": index}
        for position, index in enumerate(prompt_indices)
    ]
    write_table(pa.Table.from_pylist(rows, schema=UNIVERSE), Store(universe_uri(store.uri, sampler, epoch), store.options))


def written_epochs(store: Store, sampler: str) -> set[int]:
    """The epochs of ``sampler`` whose universe is already written in the run ``store``."""
    fs, folder = store.join("ledger", "universe", sampler).fs()
    fs.invalidate_cache()
    if not fs.exists(folder):
        return set()
    names = [path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(folder, detail=False)]
    return {int(name[len("epoch-") : -len(".parquet")]) for name in names if name.startswith("epoch-") and name.endswith(".parquet")}


def read_universe(store: Store, sampler: str, epoch: int) -> list[int]:
    """``sampler``'s prompt indices of ``epoch`` in draw order, from the run ``store``."""
    table = read_parquet(*Store(universe_uri(store.uri, sampler, epoch), store.options).fs(), columns=["position", "prompt_index"])
    return [index for _, index in sorted(zip(table["position"].to_pylist(), table["prompt_index"].to_pylist()))]


def forget_after(store: Store, step: int) -> list[int]:
    """Remove the parts of the run ``store``'s steps after ``step`` (a run starting again from ``step``
    makes them anew, perhaps from other prompts); returns the removed steps. The universe stays: the
    controller writes it again where it no longer matches the samplers."""
    fs, root = store.join("ledger").fs()
    fs.invalidate_cache()
    removed: set[int] = set()
    for table in ("groups", "open"):
        for path in fs.glob(f"{root}/{table}/step=*"):
            later = int(path.rstrip("/").rsplit("step=", 1)[-1])
            if later > step:
                fs.rm(path, recursive=True)
                removed.add(later)
    return sorted(removed)
