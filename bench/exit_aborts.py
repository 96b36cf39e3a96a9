"""How often a process that read the lake aborts at its exit (apache/arrow#34314): ``--runs`` fresh
interpreters for each reading, alternated, on the same 10 hive parts of 64 rows. The readings are

- ``dataset``: a pyarrow dataset over fsspec (``PyFileSystem(FSSpecHandler(fs))``), filtered, single
  threaded, as ``trellis lineage --sample`` read before 2026-12-03;
- ``file_object``: each part through an fsspec file object handed to ``pq.read_table(use_threads=False)``,
  as ``trellis ledger check`` and the other lake readers did before 2026-12-05 (CI saw one abort);
- ``trace_sample``: engine.storage.lineage.trace_sample, which reads one part at a time through
  engine.parquet_reads (the bytes copied into Arrow's memory first).

A run counts as aborted when its return code is negative (SIGABRT) after it printed its answer.
``--load N`` keeps N busy-looping processes running beside the readings, as a loaded CI machine has:
the aborts are a race at interpreter exit, rarer on an idle machine.

    .venv/bin/python bench/exit_aborts.py [--runs 60] [--load 0] [--out bench/results/exit_aborts.json]
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

FILE_OBJECT = """
import sys, fsspec, pyarrow.parquet as pq, torch
fs, path = fsspec.core.url_to_fs(sys.argv[1] + "/trajectories")
rows = []
for part in sorted(fs.glob(path + "/split=*/step=*/part-0.parquet")):
    with fs.open(part, "rb") as handle:
        rows += pq.read_table(handle, use_threads=False).to_pylist()
print([row["policy_version"] for row in rows if row["rollout_id"] == sys.argv[2]])
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


READINGS = {"dataset": DATASET, "file_object": FILE_OBJECT, "trace_sample": TRACE_SAMPLE}


def main(runs: int = 60, load: int = 0, out: Path = ROOT / "bench" / "results" / "exit_aborts.json") -> None:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            rollout_id = write_lake(run)
            aborted = dict.fromkeys(READINGS, 0)
            for _ in range(runs):
                for name, code in READINGS.items():
                    done = subprocess.run([sys.executable, "-c", code, str(run), rollout_id], cwd=ROOT, capture_output=True, text=True)
                    if done.returncode > 0:
                        raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
                    aborted[name] += done.returncode < 0
    finally:
        for process in busy:
            process.kill()
    result = {"runs_each": runs, "busy_processes_beside": load, "aborted": aborted}
    print(json.dumps(result))
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
