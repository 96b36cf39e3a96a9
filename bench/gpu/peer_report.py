"""What trl_peer.py and verl_peer.py report over their runs: the runs of several device calls combined
as one alternated run, the settings side by side (checked equal), every figure with its spread, and
trellis's ratios to the peer round by round."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from _compare import figures_table, settings_table, spread
from host_load import clean_host


def run_contestant(label: str, run: Callable[[], dict], *, end_leftovers_first: bool) -> dict:
    """One contestant's record, with what ``clean_host`` witnessed around it merged in; an exception
    becomes the record's ``error``, so the other contestants still run (their log says what broke)."""
    witness: dict = {}
    try:
        with clean_host(label, end_leftovers_first=end_leftovers_first) as witness:
            record = run()
    except Exception as error:
        record = {"error": f"{type(error).__name__}: {error}"[:1000]}
    return record | witness


def combined_runs(folders: list[Path]) -> tuple[dict[str, list[dict]], list[tuple[int, str]]]:
    """The runs of earlier calls (each folder's ``runs_so_far.json`` and ``order_so_far.json``), in the
    order the folders are given, as if one call had made them."""
    runs: dict[str, list[dict]] = {}
    order: list[tuple[int, str]] = []
    for folder in folders:
        for name, made in json.loads((folder / "runs_so_far.json").read_text()).items():
            runs.setdefault(name, []).extend(made)
        order += [tuple(pair) for pair in json.loads((folder / "order_so_far.json").read_text())]
    return runs, order


def report(args: argparse.Namespace, runs: dict[str, list[dict]], order: list[tuple[int, str]], *, peer: str,
           figure_formats: dict[str, str], differ_by_design: dict[str, str], warmup_steps: int) -> dict:
    """The settings side by side (checked equal), every figure's median with its spread, and each trellis
    contestant's ratios to ``peer`` round by round."""
    ok = {name: [r for r in rs if "error" not in r] for name, rs in runs.items()}
    columns = {f"{name}[{i}]": r["settings"] for name, rs in ok.items() for i, r in enumerate(rs, 1)}
    table, unequal = settings_table(columns, differ_by_design=differ_by_design) if columns else ("(no run finished)", [])
    print("\nsettings, as each side's own records say:\n" + table)
    figures = {name: {k: [r[k] for r in rs if r.get(k) is not None] for k in figure_formats} for name, rs in ok.items() if rs}
    if figures:
        print("\nfigures (tokens: trained response tokens, from each side's own records):\n" + figures_table(figures, figure_formats))
    summary = {"order": [f"{name}[{round_}]" for round_, name in order], "warmup_steps": warmup_steps, "steps": args.steps,
               "vllm_memory": args.vllm_memory, "unequal_settings": unequal, "runs": runs,
               "figures": {name: {k: spread(v) for k, v in f.items() if v} for name, f in figures.items()}}
    for name in (name for name in ok if name != peer):  # the trellis contestants
        if ok.get(peer) and ok[name]:
            pairs = list(zip(ok[peer], ok[name]))
            step = spread(p["step_s"] / s["step_s"] for p, s in pairs)
            tgs = spread(s["trained_response_tokens_per_s"] / p["trained_response_tokens_per_s"] for p, s in pairs)
            summary[f"{name}_vs_{peer}"] = {"step_speedup": step, "trained_response_tgs": tgs}
            print(f"{name} vs {peer}, round by round: step {step['median']:.2f}x faster ({step['min']:.2f}x .. {step['max']:.2f}x), "
                  f"trained response tokens/s {tgs['median']:.2f}x ({tgs['min']:.2f}x .. {tgs['max']:.2f}x), n={step['n']}")
    if unequal:
        print(f"\nNOT A FAIR COMPARISON: {', '.join(unequal)} differ between the sides.")
    return summary
