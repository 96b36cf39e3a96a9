"""async_vs_colocated.py's report: the runs' settings side by side (checked equal), every figure's
median with its spread, and the ratio of the two trainers round by round; over the runs of one call,
or over run files from several calls (``--combine``)."""

from __future__ import annotations

import json
from pathlib import Path

from _compare import figures_table, settings_table, spread

MODES = ("colocated", "disaggregated")

DIFFER_BY_DESIGN = {
    "trainer": "the two trainers compared",
    "max_staleness, tail lane trigger": "the asynchronous trainer's own settings",
    "GPUs held": "each mode holds what it needs",
    "vLLM gpu_memory_utilization": "a colocated engine shares its GPU with the trainer",
    # a colocated run puts one engine beside each trainer rank; a disaggregated run may split its rollout share
    # over several engines (--rollout-workers), each a host process of its own: a setting the colocated mode lacks
    "rollout engines": "colocated: one beside each trainer rank; disaggregated: --rollout-workers",
}


FIGURES = {  # printed for every mode, median over the rounds with the spread beside it
    "trained_tokens_per_s": ",.0f",
    "trained_tokens_per_s_per_gpu": ",.0f",
    "trained_response_tokens_per_s": ",.0f",
    "trained_tokens": ",.0f",
    "trained_response_tokens": ",.0f",
    "response_len_mean": ",.1f",
    "response_len_max": ",.0f",
    "step_s_median": ".2f",
    "measured_wall_s": ".1f",
    "weight_sync_s_median": ".3f",
    "producer_paused_s_median": ".3f",
    "gpu_idle_fraction_mean": ".2f",
    "mismatch_k3_median": ".2e",
    "goodput_percent": ".1f",
    "goodput_idle_share": ".2f",
    "goodput_discarded_share": ".2f",
    "core_loop_ms_median": ".1f",  # the host's core speed while the run ran (host_load.CoreSpeed)
}


def combine(folders: list[Path]) -> dict:
    """The report over runs made in separate calls (``--mode M --rounds 1 --round K`` each, since one
    device call cannot hold four runs): every ``run_<mode>_<round>.json`` under ``folders``, in the order
    they started."""
    found = []
    for path in (p for folder in folders for p in folder.glob("run_*_*.json")):
        mode, round_ = path.stem.removeprefix("run_").rsplit("_", 1)
        if mode in MODES:
            run = json.loads(path.read_text())
            if "core_loop_ms_median" not in run:  # made before the run file kept the host's witness: it is in the call's summary
                run |= _witness_beside(path.parent, mode, run["round"])
            found.append((run.get("started_at", path.stat().st_mtime), mode, int(round_), run))
    found.sort(key=lambda item: item[0])
    by_mode = {mode: [run for _, m, _, run in found if m == mode] for mode in MODES}
    runs = {mode: mode_runs for mode, mode_runs in by_mode.items() if mode_runs}
    return report(runs, [f"{mode}[{round_}]" for _, mode, round_, _ in found])


def _witness_beside(folder: Path, mode: str, round_: int) -> dict:
    for summary in folder.glob(f"async_vs_colocated_{mode}*.json"):
        for run in json.loads(summary.read_text()).get("runs", {}).get(mode, []):
            if run.get("round") == round_:
                return {k: run[k] for k in ("host_before", "core_loop_ms", "core_loop_ms_median") if k in run}
    return {}


def report(runs: dict[str, list[dict]], order: list[str]) -> dict:
    """The settings side by side (checked equal) and every figure's median with its spread; with both
    modes, their ratio round by round."""
    modes = list(runs)
    columns = {f"{mode}[{r['round']}]": r["settings"] for mode in modes for r in runs[mode]}
    table, unequal = settings_table(columns, differ_by_design=DIFFER_BY_DESIGN)
    print("\nsettings, as each run's own config and metrics say:\n" + table)
    figures = {mode: {k: [r[k] for r in runs[mode] if r.get(k) is not None] for k in FIGURES} for mode in modes}
    print("\nfigures (tokens/s = trained tokens, prompt + response of every trained sample, over the wall time of the "
          "measured steps: normalised by trained tokens, as the trained lengths differ):\n" + figures_table(figures, FIGURES))
    summary = {"order": order, "unequal_settings": unequal, "runs": runs,
               "figures": {mode: {k: spread(v) for k, v in f.items() if v} for mode, f in figures.items()}}
    if len(modes) == 2:
        by_round = {mode: {r["round"]: r for r in runs[mode]} for mode in modes}
        paired = sorted(set(by_round["colocated"]) & set(by_round["disaggregated"]))
        ratios = [by_round["disaggregated"][k]["trained_tokens_per_s"] / by_round["colocated"][k]["trained_tokens_per_s"] for k in paired]
        if ratios:
            s = summary["disaggregated_vs_colocated_trained_tokens_per_s"] = spread(ratios)
            print(f"\ndisaggregated / colocated, trained tokens/s, round by round: median {s['median']:.2f}x "
                  f"({s['min']:.2f}x .. {s['max']:.2f}x, n={s['n']})")
    if unequal:
        print(f"\nNOT A FAIR COMPARISON: {', '.join(unequal)} differ between the runs.")
    return summary
