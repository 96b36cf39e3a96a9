"""What a rollback of the stability guard sets aside, and the record of every trip.

```
{run}/rollbacks/trips.jsonl                       one line per trip: step, rules, values, what was done
{run}/rollbacks/rollback=NN/trip.json             the trip that made rollback NN, and the steps it discarded
{run}/rollbacks/rollback=NN/trajectories/...      the discarded steps' lake partitions (train and eval), as they were
{run}/rollbacks/rollback=NN/lineage/...           their lineage records
{run}/rollbacks/rollback=NN/ledger/...            their ledger parts
{run}/rollbacks/rollback=NN/metrics.jsonl         their metrics lines
```

The run's own lake, ledger and metrics then describe the run as it stands: the steps after the
checkpoint it went back to are run again and written anew, and nothing reads the set-aside rows for
training. With ``guard.skip_batches`` the prompts of the discarded steps are not drawn again, so the
ledger ends their groups with a ``rolled_back`` row (``ledger/groups/step=N/part-K.parquet``, K >= 1,
kept when the step runs again).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from trellis.engine.parquet_reads import read_parquet
from trellis.engine.storage.json_lines import whole_lines
from trellis.engine.storage.lake import write_part
from trellis.engine.storage.lake_query import GOODPUT_PREFIX
from trellis.engine.storage.ledger import GROUPS
from trellis.engine.storage.store import Store

ROLLED_BACK = "rolled_back"


def rollbacks_root(run: Store) -> Store:
    return run.join("rollbacks")


def read_trips(run: Store) -> list[dict[str, Any]]:
    """Every trip of the run, oldest first."""
    return _json_lines(rollbacks_root(run).join("trips.jsonl"))


def _json_lines(target: Store) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file, in order; none when it does not exist."""
    if not target.exists():
        return []
    with target.open("r") as handle:
        return whole_lines(handle.read(), source=target.uri)


def record_trip(run: Store, trip: dict[str, Any]) -> None:
    """Add ``trip`` to ``trips.jsonl`` (rewritten whole: object stores have no append)."""
    lines = [json.dumps(entry, sort_keys=True) for entry in [*read_trips(run), trip]]
    rollbacks_root(run).join("trips.jsonl").replace_text("\n".join(lines) + "\n")
    if trip.get("rollback"):
        rollbacks_root(run).join(f"rollback={trip['rollback']:02d}", "trip.json").replace_text(json.dumps(trip, indent=1, sort_keys=True))


def set_aside(run: Store, rollback: int, steps: list[int], *, skip_batches: bool) -> str:
    """Move the records of ``steps`` under ``rollbacks/rollback=NN/``; returns that folder's URI. With
    ``skip_batches``, the groups those steps ended stay ended, the ``trained`` ones as ``rolled_back``."""
    archive = rollbacks_root(run).join(f"rollback={rollback:02d}")
    fs, root = run.fs()
    fs.invalidate_cache()
    _, archive_path = archive.fs()
    fs.makedirs(archive_path, exist_ok=True)  # trip.json goes here even when the steps left no partition (debug_train)
    for step in steps:
        name = f"step={step:06d}"
        for folder in ("trajectories/split=train", "trajectories/split=eval", "ledger/groups", "ledger/open"):
            source = f"{root}/{folder}/{name}"
            if folder == "ledger/groups" and skip_batches and fs.exists(f"{source}/part-0.parquet"):
                _end_as_rolled_back(run, step, f"{source}/part-0.parquet", fs)
            if fs.exists(f"{source}/part-0.parquet"):
                fs.makedirs(f"{archive_path}/{folder}/{name}", exist_ok=True)
                fs.mv(f"{source}/part-0.parquet", f"{archive_path}/{folder}/{name}/part-0.parquet")
        for split in ("train", "eval"):
            record = f"{root}/lineage/{split}/{name}.json"
            if fs.exists(record):
                fs.makedirs(f"{archive_path}/lineage/{split}", exist_ok=True)
                fs.mv(record, f"{archive_path}/lineage/{split}/{name}.json")
    _set_aside_metrics(run, archive, min(steps))
    return archive.uri


def _end_as_rolled_back(run: Store, step: int, part: str, fs) -> None:
    rows = read_parquet(fs, part).to_pylist()
    # Every row stays (a filtered group's prompt is ended as before); the trained ones end as rolled back.
    ended = [{**row, "status": ROLLED_BACK, "reason": "trained in a step the stability guard rolled back"}
             if row["status"] == "trained" else row for row in rows]
    if not ended:
        return
    folder = run.join("ledger", "groups", f"step={step:06d}")
    taken = len(fs.glob(f"{folder.fs()[1]}/part-*.parquet"))  # part-0 is the step's own; later parts, earlier rollbacks'
    write_part(pa.Table.from_pylist(ended, schema=GROUPS), folder, part=taken)


def _set_aside_metrics(run: Store, archive: Store, first: int) -> None:
    """The metrics lines of the steps from ``first`` on, copied beside the rest; the run's tracker drops
    them from ``metrics.jsonl`` when it writes those steps again."""
    lines = [json.dumps(line, sort_keys=True) for line in _json_lines(run.join("logs", "metrics.jsonl")) if line["step"] >= first]
    if lines:
        archive.join("metrics.jsonl").replace_text("\n".join(lines) + "\n")


def set_aside_device_s(archive: Store) -> float:
    """The device-seconds the set-aside steps had logged (their ``goodput/device_s/*``)."""
    lines = _json_lines(archive.join("metrics.jsonl"))
    return sum(value for line in lines for key, value in line.items() if key.startswith(GOODPUT_PREFIX))
