"""What a bench that compares contestants shares: they run alternately (A B A B ...), so that the
machine's drift hits all alike; every figure is shown as its median with its spread beside it; and the
settings each side really ran with (read back from its own records) are printed side by side and
checked equal, so that an unlike comparison fails instead of printing a ratio."""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence


def alternated(names: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, contestant) in the order to run them: every contestant once per round."""
    return [(round_, name) for round_ in range(1, rounds + 1) for name in names]


def spread(values: Iterable[float]) -> dict[str, float]:
    """The median of ``values`` and its spread: min, max and how many values."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def with_spread(values: Iterable[float], spec: str = ".3f") -> str:
    """``median (min .. max, n)``: the median never travels without its spread."""
    s = spread(values)
    return f"{s['median']:{spec}} ({s['min']:{spec}} .. {s['max']:{spec}}, n={s['n']})"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def settings_table(settings: Mapping[str, Mapping[str, Any]], *, differ_by_design: Mapping[str, str] | None = None) -> tuple[str, list[str]]:
    """Each contestant's settings in a column, and whether every row is equal across them. Rows in
    ``differ_by_design`` (row -> why) may differ; any other row that differs is returned as unequal."""
    differ_by_design = differ_by_design or {}
    names = list(settings)
    keys = list(dict.fromkeys(key for values in settings.values() for key in values))
    rows, unequal = [], []
    for key in keys:
        cells = [settings[name].get(key, "-") for name in names]
        if key in differ_by_design:
            verdict = f"differs by design: {differ_by_design[key]}"
        elif all(cell == cells[0] for cell in cells):
            verdict = "equal"
        else:
            verdict = "NOT EQUAL"
            unequal.append(key)
        rows.append([key, *map(str, cells), verdict])
    return _table(["setting", *names, ""], rows), unequal


def figures_table(figures: Mapping[str, Mapping[str, Sequence[float]]], specs: Mapping[str, str]) -> str:
    """One row per figure (``specs``: figure -> format), one column per contestant: median (spread)."""
    names = list(figures)
    rows = []
    for key, spec in specs.items():
        rows.append([key, *(with_spread(figures[n][key], spec) if figures[n].get(key) else "-" for n in names)])
    return _table(["figure: median (min .. max, n)", *names], rows)


def run_sides(sides: Mapping[str, Any], rounds: int, run: Callable[[Any, int], dict], figures: Sequence[str]) -> dict:
    """Run every side once per round, alternately (``run(setting, round)`` returns a run's figures), printing
    each run, then every figure's median with its spread per side; returns the command, the runs and the figures."""
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for round_, name in alternated(list(sides), rounds):
        result = run(sides[name], round_)
        runs[name].append(result)
        print(f"round {round_} {name}: " + ", ".join(f"{k} {result[k]:.6g}" for k in figures), flush=True)
    summary = {"command": " ".join(sys.argv), "runs": runs,
               "figures": {name: {k: spread(r[k] for r in side) for k in figures} for name, side in runs.items()}}
    print("\nmedian (min .. max) over the rounds:")
    for name, by_figure in summary["figures"].items():
        print(f"  {name}: " + "; ".join(f"{k} {f['median']:.6g} ({f['min']:.6g} .. {f['max']:.6g})" for k, f in by_figure.items()))
    return summary
