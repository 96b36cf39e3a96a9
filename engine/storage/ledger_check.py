"""Checking a run's ledger (``engine.storage.ledger``): every prompt drawn is open or ended exactly once.

For each sampler and epoch the check takes the epoch's universe (every prompt, in draw order), how far
the sampler had drawn at the ledger's latest step, and the prompts open then; a prompt drawn and not
open that no row ends is *missing*, one ended by several rows is *doubled*, and a row for a prompt not
drawn (or still open, or in no universe) is *unexpected*. Reads through fsspec: local or ``s3://``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import fsspec

from trellis.engine.parquet_reads import read_parquet
from trellis.engine.storage.ledger import ENDING, STATUSES
from trellis.engine.storage.store import Store

Prompt = tuple[str, int, int]  # (sampler, epoch, prompt_index)


class LedgerMissingError(LookupError):
    """The run has no ledger (yet), or a part of it is missing."""


@dataclass
class EpochCheck:
    sampler: str
    epoch: int
    prompts: int  # in the epoch's universe
    drawn: int
    open: int
    statuses: Counter = field(default_factory=Counter)  # rows by status (expired ones included)
    missing: list[int] = field(default_factory=list)  # prompt indices
    doubled: dict[int, list[str]] = field(default_factory=dict)  # prompt index -> "status@step" of each ending row
    unexpected: dict[int, str] = field(default_factory=dict)  # prompt index -> why

    @property
    def finished(self) -> bool:
        return self.drawn == self.prompts and self.open == 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.doubled or self.unexpected)


@dataclass
class LedgerCheck:
    run_uri: str
    last_step: int
    epochs: list[EpochCheck]
    outside: list[str]  # rows whose (sampler, epoch) has no universe

    @property
    def ok(self) -> bool:
        return not self.outside and all(epoch.ok for epoch in self.epochs)


def check_ledger(run: Store, epoch: int | None = None) -> LedgerCheck:
    run_uri = run.uri
    fs, root = run.join("ledger").fs()
    fs.invalidate_cache()
    groups = _read_parts(fs, root, "groups")
    state = _read_parts(fs, root, "open")
    if not groups and not state:
        raise LedgerMissingError(f"{run_uri} has no ledger: nothing under {run_uri.rstrip('/')}/ledger/groups/.")
    last_step = max(row["train_step"] for row in groups + state)
    latest = [row for row in state if row["train_step"] == last_step]
    if not latest:
        raise LedgerMissingError(
            f"The ledger of step {last_step} is incomplete (no ledger/open part): the run stopped while writing it. "
            "Resume the run (it rewrites the step) before checking."
        )
    drawn = {row["sampler"]: (row["epoch"], row["position"]) for row in latest if row["kind"] == "drawn"}
    still_open = {(row["sampler"], row["epoch"], row["prompt_index"]) for row in latest if row["kind"] == "open"}
    universes = _read_universes(fs, root)

    ending: dict[Prompt, list[str]] = defaultdict(list)
    statuses: dict[tuple[str, int], Counter] = defaultdict(Counter)
    for row in groups:
        key = (row["sampler"], row["epoch"], row["prompt_index"])
        statuses[key[:2]][row["status"]] += 1
        if row["status"] in ENDING:
            ending[key].append(f"{row['status']}@{row['train_step']}")
    outside = sorted(
        f"{sampler} epoch {e} prompt {p}" for (sampler, e, p) in {**ending, **dict.fromkeys(still_open)} if (sampler, e) not in universes
    )
    checks = []
    for (sampler, e), order in sorted(universes.items()):
        if epoch is not None and e != epoch:
            continue
        reached_epoch, position = drawn.get(sampler, (-1, 0))
        count = len(order) if e < reached_epoch else position if e == reached_epoch else 0
        checks.append(_check_epoch(sampler, e, order, set(order[:count]), still_open, ending, statuses[(sampler, e)]))
    return LedgerCheck(run_uri, last_step, checks, outside)


def _check_epoch(
    sampler: str, epoch: int, order: list[int], drawn: set[int], still_open: set[Prompt], ending: dict[Prompt, list[str]],
    statuses: Counter,
) -> EpochCheck:
    opened = {p for (s, e, p) in still_open if (s, e) == (sampler, epoch)}
    check = EpochCheck(sampler, epoch, len(order), len(drawn), len(opened), statuses)
    in_universe = set(order)
    for prompt in sorted(in_universe | {p for (s, e, p) in ending if (s, e) == (sampler, epoch)} | opened):
        ends = ending.get((sampler, epoch, prompt), [])
        if prompt not in in_universe:
            check.unexpected[prompt] = "not in the epoch's prompts"
        elif prompt not in drawn and (ends or prompt in opened):
            check.unexpected[prompt] = "not drawn yet, but " + ("ended: " + ", ".join(ends) if ends else "open")
        elif prompt in opened and ends:
            check.unexpected[prompt] = "still open, but ended: " + ", ".join(ends)
        elif len(ends) > 1:
            check.doubled[prompt] = ends
        elif prompt in drawn and prompt not in opened and not ends:
            check.missing.append(prompt)
    return check


def _read_parts(fs: fsspec.AbstractFileSystem, root: str, table: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    # groups: a step's own part-0, and the rows a rollback ended in its later parts (engine.storage.rollbacks)
    parts = "part-*.parquet" if table == "groups" else "part-0.parquet"
    for path in sorted(fs.glob(f"{root}/{table}/step=*/{parts}")):
        rows += read_parquet(fs, path).to_pylist()
    return rows


def _read_universes(fs: fsspec.AbstractFileSystem, root: str) -> dict[tuple[str, int], list[int]]:
    universes: dict[tuple[str, int], list[int]] = {}
    for path in sorted(fs.glob(f"{root}/universe/*/epoch-*.parquet")):
        rows = read_parquet(fs, path).to_pylist()
        if rows:
            key = (rows[0]["sampler"], rows[0]["epoch"])
            universes[key] = [row["prompt_index"] for row in sorted(rows, key=lambda row: row["position"])]
    return universes


def render(check: LedgerCheck) -> list[str]:
    """The check as lines: a table of epochs, then every violation by name."""
    lines = [f"ledger of {check.run_uri} through step {check.last_step}"]
    header = ["sampler", "epoch", "prompts", "drawn", "open", *STATUSES, "state"]
    rows = [
        [c.sampler, c.epoch, c.prompts, c.drawn, c.open, *(c.statuses.get(s, 0) for s in STATUSES),
         ("finished" if c.finished else "in progress") + ("" if c.ok else ", VIOLATED")]
        for c in check.epochs
    ]
    widths = [max(len(str(value)) for value in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        lines.append("  ".join(str(value).ljust(width) if i == 0 else str(value).rjust(width) for i, (value, width) in enumerate(zip(row, widths))))
    for c in check.epochs:
        where = f"{c.sampler} epoch {c.epoch}"
        lines += [f"missing: {where} prompt {p}: drawn, not open, and no row ends it" for p in c.missing]
        lines += [f"doubled: {where} prompt {p}: ended {len(ends)} times ({', '.join(ends)})" for p, ends in c.doubled.items()]
        lines += [f"unexpected: {where} prompt {p}: {why}" for p, why in c.unexpected.items()]
    lines += [f"unexpected: {where}: no universe written for its epoch" for where in check.outside]
    violations = sum(len(c.missing) + len(c.doubled) + len(c.unexpected) for c in check.epochs) + len(check.outside)
    lines.append("every prompt accounted for exactly once" if check.ok else f"{violations} violation(s)")
    return lines
