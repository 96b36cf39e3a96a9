"""``trellis runs`` and ``trellis trajectories``: how far each run got, DuckDB SQL over a run's
trajectory lake, and one stored step's prompts and responses, from the shell.

The main CLI registers ``runs_app`` and ``trajectories_app``. A wrong run, step, split or query prints
one red line on stderr and exits with code 2.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum
from typing import Annotated, Any

import typer

from trellis.deployments.run_options import (
    ConfigOption,
    StorageOption,
    WorkDirOption,
    run_ref,
    storage_location,
)
from trellis.engine.storage.runs import RunNotFoundError, split_run_step

runs_app = typer.Typer(no_args_is_help=True, help="The runs under a work_dir: steps, rewards, evaluations, checkpoints.")
trajectories_app = typer.Typer(
    no_args_is_help=True, help="A run's stored samples: DuckDB SQL over them, or one step's prompts and responses."
)

RunArgument = Annotated[str, typer.Argument(help="A run name under the work_dir, or a run folder's URI.")]
CELL_WIDTH = 48  # a query table's cells are cut to this many characters; csv and json are not


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


@contextmanager
def operator_errors() -> Iterator[None]:
    """A mistake in what was typed (or a missing run, step or file) as one red line and exit code 2."""
    from trellis.engine.config.loading import ConfigError
    from trellis.engine.storage.lake_query import QueryError

    try:
        yield
    except (RunNotFoundError, QueryError, ConfigError, FileNotFoundError, PermissionError) as error:
        typer.secho(str(error), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None


# -- runs ls ---------------------------------------------------------------------------------------


@runs_app.command("ls")
def runs_ls(
    work_dir: Annotated[
        str | None, typer.Argument(help="Where runs live (any fsspec URI); default: the config's, else work_dirs.")
    ] = None,
    config: ConfigOption = None,
    storage_option: StorageOption = [],  # noqa: B006
) -> None:
    """One line per run: steps done of planned, last train reward, last eval accuracy, checkpoints, goodput."""
    from trellis.engine.storage.lake_query import list_runs
    from trellis.engine.storage.store import Store

    with operator_errors():
        root, storage = storage_location(work_dir, config, storage_option)
        summaries = list_runs(Store(root, storage))
    if not summaries:
        typer.echo(f"No runs under {root}.")
        return
    rows = [
        [
            s.name,
            f"{_or_dash(s.last_step)}/{_or_dash(s.total_steps)}",
            _or_dash(s.last_reward, "{:.3f}"),
            "-" if s.last_eval_accuracy is None else f"{s.last_eval_accuracy:.3f}@{s.last_eval_step}",
            _some_steps(s.checkpoint_steps),
            _some_steps(s.hf_steps),
            "-" if s.goodput_percent is None else f"{s.goodput_percent:.0f}%",
        ]
        for s in summaries
    ]
    typer.echo(render_table(["RUN", "STEPS", "REWARD", "EVAL ACC@STEP", "CHECKPOINTS", "HF", "GOODPUT"], rows))


def _or_dash(value: Any, form: str = "{}") -> str:
    return "-" if value is None else form.format(value)


def _some_steps(steps: tuple[int, ...], shown: int = 3) -> str:
    """The newest few steps: ``2, 4`` or ``… 40, 50, 60``."""
    if not steps:
        return "-"
    newest = ", ".join(str(step) for step in steps[-shown:])
    return newest if len(steps) <= shown else f"… {newest}"


# -- trajectories query ----------------------------------------------------------------------------


@trajectories_app.command("query")
def trajectories_query(
    run: RunArgument,
    sql: Annotated[str, typer.Argument(help="DuckDB SQL over the views `trajectories` (with split, step) and `ledger`.")],
    work_dir: WorkDirOption = None,
    config: ConfigOption = None,
    storage_option: StorageOption = [],  # noqa: B006
    output_format: Annotated[OutputFormat, typer.Option("--format", help="How to print the result.")] = OutputFormat.table,
) -> None:
    """Run SQL over a run's trajectories (every split and step) and ledger."""
    from trellis.engine.storage.lake_query import query

    with operator_errors():
        table = query(run_ref(run, work_dir, config, storage_option), sql)
    names = table.column_names
    rows = [list(row) for row in zip(*(column.to_pylist() for column in table.columns))]
    if output_format is OutputFormat.csv:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(names)
        writer.writerows([[_csv_cell(value) for value in row] for row in rows])
        typer.echo(buffer.getvalue(), nl=False)
    elif output_format is OutputFormat.json:
        records = [json.dumps(dict(zip(names, _plain(row))), ensure_ascii=False) for row in rows]
        typer.echo("[\n" + ",\n".join(records) + "\n]" if records else "[]")
    else:
        import pyarrow as pa

        numeric = [pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) for t in table.schema.types]
        typer.echo(render_table(names, [[_table_cell(value) for value in row] for row in rows], right=numeric))
        typer.echo(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")


def _plain(value: Any) -> Any:
    """A query value as JSON has it: NaN as null, decimals as numbers, dates as ISO text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(_plain(value), ensure_ascii=False)
    return _plain(value)


def _table_cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, dict)):
        text = json.dumps(_plain(value), ensure_ascii=False)
    else:
        text = str(_plain(value))
    text = text.replace("\n", "\\n")
    return text if len(text) <= CELL_WIDTH else text[: CELL_WIDTH - 1] + "…"


def render_table(headers: list[str], rows: list[list[str]], right: list[bool] | None = None) -> str:
    """Columns padded to their widest cell, two spaces apart; ``right`` aligns numbers to the right."""
    right = right or [False] * len(headers)
    widths = [max([len(header), *(len(row[i]) for row in rows)]) for i, header in enumerate(headers)]

    def line(cells: list[str]) -> str:
        padded = [cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(cells, widths, right)]
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), *(line(row) for row in rows)])


# -- trajectories show -----------------------------------------------------------------------------


@trajectories_app.command("show")
def trajectories_show(
    run: Annotated[str, typer.Argument(help="A run name under the work_dir or a run folder's URI; RUN@STEP names the step.")],
    step: Annotated[int | None, typer.Option("--step", help="The training step (0: the initial evaluation).")] = None,
    split: Annotated[str, typer.Option(help="train, or eval.")] = "train",
    limit: Annotated[int, typer.Option(help="Show this many prompts, each with all its responses; 0: all.")] = 8,
    max_chars: Annotated[int, typer.Option(help="Cut each prompt and response to this many characters; 0: never.")] = 400,
    work_dir: WorkDirOption = None,
    config: ConfigOption = None,
    storage_option: StorageOption = [],  # noqa: B006
) -> None:
    """One stored step's prompts and their responses, with rewards, grouped by prompt."""
    from trellis.engine.storage.lake_query import show_step

    try:
        run, named_step = split_run_step(run)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="RUN") from None
    step = step if step is not None else named_step
    if step is None:
        raise typer.BadParameter("Name the step: --step N, or RUN@N.", param_hint="--step")
    with operator_errors():
        ref = run_ref(run, work_dir, config, storage_option)
        samples = show_step(ref, step, split=split, limit=limit or None)

    groups: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        groups.setdefault(sample["group"], []).append(sample)
    shown = f"the first {len(groups)} prompts" if limit and len(groups) == limit else f"{len(groups)} prompts"
    typer.secho(f"{ref.name} · {split} step {step} · {shown}", bold=True)
    for group, members in groups.items():
        rewards = [m["reward"] for m in members if m["reward"] is not None]
        mean = f"mean reward {sum(rewards) / len(rewards):.3f}" if rewards else "no rewards"
        typer.echo("")
        typer.secho(f"{group}  ({len(members)} responses, {mean})", bold=True)
        typer.echo(_labelled("prompt", members[0]["prompt"], max_chars))
        for image in members[0]["images"]:
            typer.echo(_labelled("image", image, 0))
        if members[0]["label"] is not None:
            typer.echo(_labelled("label", members[0]["label"], max_chars))
        for member in members:
            typer.echo(_response_line(member, max_chars))


def _labelled(label: str, text: str, max_chars: int) -> str:
    return _indented(f"  {label + ':':<8}", _cut(text, max_chars))


def _response_line(sample: dict[str, Any], max_chars: int) -> str:
    reward = "   -  " if sample["reward"] is None else f"{sample['reward']:6.2f}"
    notes = [note for note in (sample["status"], sample["finish_reason"]) if note not in ("completed", "stop", None)]
    suffix = typer.style(f"  [{', '.join(notes)}]", fg=typer.colors.YELLOW) if notes else ""
    colour = typer.colors.GREEN if (sample["reward"] or 0) > 0 else None
    head = typer.style(reward, fg=colour) + "  "
    return _indented(head, _cut(sample["response"] or "", max_chars), width=len(reward) + 2) + suffix


def _indented(head: str, text: str, width: int | None = None) -> str:
    """``text`` after ``head``, its further lines indented under its first."""
    pad = " " * (len(head) if width is None else width)
    return head + text.replace("\n", "\n" + pad)


def _cut(text: str, max_chars: int) -> str:
    if not max_chars or len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}… (+{len(text) - max_chars} characters)"
