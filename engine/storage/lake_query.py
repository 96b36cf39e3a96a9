"""A run's records read from the operator's side: what each run has done (``run_summary``,
``list_runs``), SQL over its trajectory lake and ledger (``query``), and one stored step's prompts and
responses (``show_step``).

Everything is read through fsspec, so a local folder and ``s3://`` read alike: DuckDB scans pyarrow
datasets whose files are opened by the run's fsspec filesystem, and needs no extension of its own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileSystem

from trellis.engine.parquet_reads import read_parquet
from trellis.engine.storage.checkpoints import SaveStore
from trellis.engine.storage.store import Store
from trellis.engine.storage.lake import stored_steps
from trellis.engine.storage.runs import RunNotFoundError, RunRef, run_folders

GOODPUT_PREFIX = "goodput/device_s/"  # engine.run.goodput's split of a step's device-seconds


@dataclass(frozen=True)
class View:
    """A SQL view over a run: the Parquet files under ``folder`` matching ``files``, with the Hive
    partition columns their paths add."""

    folder: str
    files: str
    partitions: tuple[tuple[str, pa.DataType], ...] = ()


# ledger: every group a step resolved; ledger_open: what each step left open; ledger_universe: each epoch's prompts.
VIEWS: dict[str, View] = {
    "trajectories": View("trajectories", "split=*/step=*/part-*.parquet", (("split", pa.string()), ("step", pa.int64()))),
    "ledger": View("ledger/groups", "step=*/part-*.parquet", (("step", pa.int64()),)),
    "ledger_open": View("ledger/open", "step=*/part-*.parquet", (("step", pa.int64()),)),
    "ledger_universe": View("ledger/universe", "*/epoch-*.parquet"),
}


class QueryError(RuntimeError):
    """SQL over a run failed; ``str()`` is one line, ``duckdb_message`` is DuckDB's whole message."""

    def __init__(self, message: str, duckdb_message: str | None = None) -> None:
        super().__init__(message)
        self.duckdb_message = duckdb_message


# -- runs ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSummary:
    name: str
    uri: str
    last_step: int | None  # the last step in logs/metrics.jsonl; 0 when only the initial evaluation ran
    total_steps: int | None  # from logs/run_plan.json
    last_reward: float | None  # response/rewards/mean of the last train step
    last_eval_accuracy: float | None
    last_eval_step: int | None
    checkpoint_steps: tuple[int, ...]  # complete checkpoints only
    hf_steps: tuple[int, ...]  # complete HF exports only
    goodput_percent: float | None = None  # of the logged steps' device-seconds (engine.run.goodput)


def list_runs(work_dir: Store) -> list[RunSummary]:
    return [run_summary(ref) for ref in run_folders(work_dir)]


def run_summary(ref: RunRef) -> RunSummary:
    fs, path = ref.filesystem()
    metrics = _metrics_by_step(fs, f"{path}/logs/metrics.jsonl")
    trained = [step for step, record in metrics.items() if "response/rewards/mean" in record]
    evaluated = [step for step, record in metrics.items() if "eval/accuracy" in record]
    return RunSummary(
        name=ref.name,
        uri=ref.uri,
        last_step=max(metrics, default=None),
        total_steps=_planned_total_steps(fs, f"{path}/logs/run_plan.json"),
        last_reward=metrics[trained[-1]]["response/rewards/mean"] if trained else None,
        last_eval_accuracy=metrics[evaluated[-1]]["eval/accuracy"] if evaluated else None,
        last_eval_step=evaluated[-1] if evaluated else None,
        checkpoint_steps=tuple(SaveStore(ref.join("checkpoints")).complete_steps()),
        hf_steps=tuple(SaveStore(ref.join("hf")).complete_steps()),
        goodput_percent=run_goodput(metrics),
    )


def run_goodput(steps: dict[int, dict[str, Any]]) -> float | None:
    """A run's goodput %: its steps' device-seconds that made trained tokens over all of them (the
    ``goodput/device_s/*`` of ``engine.run.goodput``); None when no step logged any."""
    totals = goodput_device_seconds(steps)
    whole = sum(totals.values())
    return 100.0 * totals.get("trained_tokens", 0.0) / whole if whole > 0 else None


def goodput_device_seconds(steps: dict[int, dict[str, Any]]) -> dict[str, float]:
    """The device-seconds of ``steps`` summed by where they went (``trained_tokens``, ``idle``,
    ``discarded/expired``...: the names under ``goodput/device_s/``)."""
    totals: dict[str, float] = {}
    for record in steps.values():
        for key, value in record.items():
            if key.startswith(GOODPUT_PREFIX):
                name = key.removeprefix(GOODPUT_PREFIX)
                totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def _metrics_by_step(fs: fsspec.AbstractFileSystem, path: str) -> dict[int, dict[str, Any]]:
    """metrics.jsonl merged by step, in step order; a step logged again after a resume keeps the later values."""
    if not fs.exists(path):
        return {}
    by_step: dict[int, dict[str, Any]] = {}
    for line in fs.cat_file(path).decode().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a run that is writing it right now
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step.setdefault(record["step"], {}).update(record)
    return dict(sorted(by_step.items()))


def _planned_total_steps(fs: fsspec.AbstractFileSystem, path: str) -> int | None:
    if not fs.exists(path):
        return None
    try:
        return int(json.loads(fs.cat_file(path))["total_steps"])
    except (ValueError, KeyError, TypeError):
        return None


# -- SQL -------------------------------------------------------------------------------------------


def query(ref: RunRef, sql: str) -> pa.Table:
    """Run DuckDB ``sql`` over the run's views (``trajectories``: every split and step, with ``split``
    and ``step`` columns; ``ledger`` where the run has one) and return the result."""
    views = lake_views(ref)
    wanted = [name for name in VIEWS if re.search(rf"\b{name}\b", sql, re.IGNORECASE)]
    absent = [name for name in wanted if name not in views]
    if absent:
        raise QueryError(f"{ref.name} has no {absent[0]} yet: no Parquet parts under {ref.uri}/{VIEWS[absent[0]].folder}/.")
    connection = duckdb.connect()
    try:
        for name, dataset in views.items():
            connection.register(name, dataset)
        try:
            relation = connection.sql(sql)
            if relation is None:  # a statement without a result (CREATE, SET, ...)
                return pa.table({})
            # to_arrow_table is newer DuckDBs' name for fetch_arrow_table, which they deprecate.
            to_arrow = getattr(relation, "to_arrow_table", None) or relation.fetch_arrow_table
            return to_arrow()
        except duckdb.Error as error:
            raise QueryError(_one_line(error, views), str(error)) from error
    finally:
        connection.close()


def lake_views(ref: RunRef) -> dict[str, ds.Dataset]:
    """The run's views that have at least one part, as pyarrow datasets read through fsspec."""
    fs, path = ref.filesystem()
    views = {}
    for name, view in VIEWS.items():
        root = f"{path}/{view.folder}"
        parts = sorted(fs.glob(f"{root}/{view.files}"))
        if parts:
            views[name] = _dataset(fs, root, parts, view.partitions)
    return views


def _dataset(fs: fsspec.AbstractFileSystem, root: str, parts: list[str], partitions) -> ds.Dataset:
    options = ds.FileSystemFactoryOptions(partition_base_dir=root)
    if partitions:
        options.partitioning = ds.partitioning(pa.schema(list(partitions)), flavor="hive")
    factory = ds.FileSystemDatasetFactory(_arrow_filesystem(fs), parts, ds.ParquetFileFormat(), options)
    # Every part's schema, not the first one's: parts written before a column was added lack it.
    return factory.finish(factory.inspect(promote_options="permissive", fragments=None))


def _arrow_filesystem(fs: fsspec.AbstractFileSystem) -> pafs.FileSystem:
    """Arrow's own filesystem for a local run: through a Python one (object storage), Arrow's threads call
    into the interpreter and can abort it at its exit (engine.parquet_reads)."""
    if isinstance(fs, LocalFileSystem):
        return pafs.LocalFileSystem()
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def _one_line(error: duckdb.Error, views: dict[str, ds.Dataset]) -> str:
    """DuckDB's message on one line (without its ``LINE 1: ... ^`` pointer), with the columns of the
    views when a name was not found."""
    lines = [line.strip() for line in str(error).splitlines()]
    message = " ".join(line for line in lines if line and not line.startswith("LINE ") and set(line) != {"^"})
    if isinstance(error, duckdb.BinderException) and "column" in message.lower():
        message += "".join(f" Columns of {name}: {', '.join(d.schema.names)}." for name, d in views.items())
    elif isinstance(error, duckdb.CatalogException) and views:
        message += f" Tables: {', '.join(views)}."
    return message


# -- one step --------------------------------------------------------------------------------------


def show_step(ref: RunRef, step: int, split: str = "train", limit: int | None = 8) -> list[dict[str, Any]]:
    """The stored samples of one step, the first ``limit`` prompts (groups) with all their responses
    (``None`` or 0: every group), in the order they were produced."""
    fs, path = ref.filesystem()
    part = f"{path}/trajectories/split={split}/step={step:06d}/part-0.parquet"
    if not fs.exists(part):
        raise RunNotFoundError(_missing_step(ref, fs, path, split, step))
    columns = ["group_id", "prompt", "label", "response", "reward", "status", "finish_reason"]
    rows = read_parquet(fs, part, columns=columns + ["images"]).to_pylist()
    groups: set[str] = set()
    shown = []
    for row in rows:
        if row["group_id"] not in groups:
            if limit and len(groups) == limit:
                continue
            groups.add(row["group_id"])
        group, messages = row.pop("group_id"), row.pop("prompt")
        images = [cell["uri"] or f"sha256:{cell['sha256']}" for cell in row.pop("images", None) or []]
        shown.append({"group": group, "prompt": prompt_text(messages), "images": images, **row})
    return shown


def prompt_text(messages: list[dict[str, str]] | None) -> str:
    """A lone user message as its text; a conversation as ``role: text`` lines."""
    messages = messages or []
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _missing_step(ref: RunRef, fs: fsspec.AbstractFileSystem, path: str, split: str, step: int) -> str:
    steps = stored_steps(ref, split)
    if steps:
        return f"{ref.name} has no {split} step {step}; stored {split} steps: {step_ranges(steps)}."
    root = f"{path}/trajectories"
    splits = sorted(p.rstrip("/").rsplit("split=", 1)[-1] for p in fs.glob(f"{root}/split=*")) if fs.exists(root) else []
    if splits:
        return f"{ref.name} has no {split!r} split; stored splits: {', '.join(splits)}."
    return f"{ref.name} has no trajectories yet: nothing under {ref.uri}/trajectories/."


def step_ranges(steps: list[int]) -> str:
    """[0, 2, 3, 4, 7] -> '0, 2-4, 7'."""
    spans: list[list[int]] = []
    for step in sorted(steps):
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
