"""How often a process that read the lake aborts at its exit (apache/arrow#34314): ``--runs`` fresh
interpreters for each reading, alternated, on the same 10 hive parts of 64 rows. The readings are

- ``dataset``: a pyarrow dataset over fsspec (``PyFileSystem(FSSpecHandler(fs))``), filtered, single
  threaded, as ``trellis lineage --sample`` read before 2026-12-03;
- ``trace_sample``: engine.storage.lineage.trace_sample, which reads one part at a time through fsspec.

A run counts as aborted when its return code is negative (SIGABRT) after it printed its answer.

    .venv/bin/python bench/exit_aborts.py [--runs 60] [--out bench/results/exit_aborts.json]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import typer

ROOT = Path(__file__).resolve().parents[1]

DATASET = """
import sys, fsspec, pyarrow.dataset as ds, torch
from pyarrow.fs import FSSpecHandler, PyFileSystem
fs, path = fsspec.core.url_to_fs(sys.argv[1] + "/trajectories")
dataset = ds.dataset(path, filesystem=PyFileSystem(FSSpecHandler(fs)), format="parquet", partitioning="hive")
print(dataset.to_table(columns=["split", "step"], filter=ds.field("rollout_id") == sys.argv[2], use_threads=False).to_pylist())
"""

TRACE_SAMPLE = """
import sys
from trellis.engine.storage.lineage import trace_sample
from trellis.engine.storage.store import Store
print(trace_sample(Store(sys.argv[1]), sys.argv[2]))
"""


def write_lake(run: Path) -> str:
    """Two splits of 5 steps, 64 rows each; returns a rollout_id that is in it."""
    for split in ("train", "eval"):
        for step in range(1, 6):
            folder = run / "trajectories" / f"split={split}" / f"step={step:06d}"
            folder.mkdir(parents=True)
            ids = [str(uuid.uuid4()) for _ in range(64)]
            pq.write_table(pa.table({"rollout_id": ids, "policy_version": [step] * 64, "reward": [1.0] * 64}), folder / "part-0.parquet")
    return ids[0]


def main(runs: int = 60, out: Path = ROOT / "bench" / "results" / "exit_aborts.json") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        rollout_id = write_lake(run)
        aborted = {"dataset": 0, "trace_sample": 0}
        for _ in range(runs):
            for name, code in (("dataset", DATASET), ("trace_sample", TRACE_SAMPLE)):
                done = subprocess.run([sys.executable, "-c", code, str(run), rollout_id], cwd=ROOT, capture_output=True, text=True)
                if done.returncode > 0:
                    raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
                aborted[name] += done.returncode < 0
    result = {"runs_each": runs, "aborted": aborted}
    print(json.dumps(result))
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
