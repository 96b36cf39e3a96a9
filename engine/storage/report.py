"""A run's report: PNG plots of its ``logs/metrics.jsonl`` and one self-contained ``index.html`` (the
plots embedded, plus the run's headline figures), written through fsspec beside the run or anywhere else.

Each panel draws the metric keys it knows that the run logged; a panel with none of them (staleness on
a colocated run, eval without evaluation) is left out rather than drawn empty.
"""

from __future__ import annotations

import base64
import fnmatch
import html
import io
import math
from dataclasses import dataclass, field
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trellis.engine.storage.json_lines import whole_lines
from trellis.engine.storage.lake_query import GOODPUT_PREFIX, run_goodput
from trellis.engine.storage.report_samples import pictures_html, sample_pictures
from trellis.engine.storage.store import Store

Records = list[dict[str, Any]]


class ReportError(RuntimeError):
    """The run has nothing to report yet."""


@dataclass(frozen=True)
class Panel:
    name: str  # the PNG's file name, without .png
    title: str
    ylabel: str
    # One subplot per tuple of metric keys (fnmatch patterns, so ``eval/pass@*`` finds any k).
    subplots: tuple[tuple[str, ...], ...]
    band: tuple[str, str] | None = None  # (low, high) keys shaded behind the first subplot's first line
    stacked: bool = False  # the keys' values stacked, each step's total the top line (parts of a whole)


PANELS = (
    Panel("reward", "Reward", "reward", (("response/rewards/mean",),),
          band=("response/rewards/min", "response/rewards/max")),
    Panel("eval", "Held-out evaluation", "accuracy", (("eval/accuracy", "eval/pass@*"),)),
    Panel("response_length", "Response length", "tokens", (("response/response_len/mean",),),
          band=("response/response_len/min", "response/response_len/max")),
    Panel("throughput", "Throughput (tokens/s per device)", "tokens/s", (("throughput/*_tgs",),)),
    Panel("mismatch", "Rollout vs trainer logprob mismatch", "", (
        ("mismatch/abs_logprob_diff", "mismatch/abs_logprob_diff_max"),
        ("mismatch/k3_kl",),
    )),
    Panel("staleness", "Staleness of trained samples (steps)", "steps",
          (("async/staleness_mean", "async/staleness_max"),)),
    Panel("goodput", "Where each step's device-seconds went (goodput)", "device-seconds", ((f"{GOODPUT_PREFIX}*",),),
          stacked=True),
)

HEADLINE_LABELS = {
    "steps": "Steps",
    "reward": "Reward (mean), first → last",
    "eval_accuracy": "Eval accuracy, first → last",
    "mean_step_s": "Mean step time (s)",
    "trained_tokens_per_s": "Trained tokens/s",
    "goodput_percent": "Goodput (% of device-seconds that made trained tokens)",
}


@dataclass(frozen=True)
class Report:
    html_uri: str
    png_uris: dict[str, str]  # panel name -> URI of its PNG
    headline: dict[str, Any] = field(default_factory=dict)  # see headline_figures

    def markdown(self, link: str | None = None) -> str:
        """The headline table and a link (default: the page's URI) to the full report, for a Prefect artifact."""
        lines = ["| | |", "| --- | --- |"]
        lines += [f"| {label} | {text} |" for label, text in headline_rows(self.headline)]
        return "\n".join(lines + ["", f"Plots: [{self.html_uri}]({link or self.html_uri})"])


def write_report(run: Store, out_uri: str | None = None) -> Report:
    """Plots and ``index.html`` of the run in ``run`` into ``out_uri`` (default ``{run}/report``, with the
    run's storage options either way)."""
    run_uri = run.uri.rstrip("/")
    out_uri = (out_uri or f"{run_uri}/report").rstrip("/")
    records = read_metrics(run)
    headline = headline_figures(records)
    pngs = {panel.name: png for panel in PANELS if (png := draw_panel(panel, records)) is not None}

    fs, out_path = Store(out_uri, run.options).fs()
    fs.makedirs(out_path, exist_ok=True)
    png_uris = {}
    for name, png in pngs.items():
        fs.pipe_file(f"{out_path}/{name}.png", png)
        png_uris[name] = f"{out_uri}/{name}.png"
    pictures = pictures_html(sample_pictures(run))
    fs.pipe_file(f"{out_path}/index.html", render_html(run_uri, headline, pngs, pictures).encode())
    return Report(html_uri=f"{out_uri}/index.html", png_uris=png_uris, headline=headline)


def read_metrics(run: Store) -> Records:
    """metrics.jsonl's records, one per step, in step order."""
    run_uri, metrics = run.uri.rstrip("/"), run.join("logs", "metrics.jsonl")
    uri = metrics.uri
    fs, path = metrics.fs()
    fs.invalidate_cache()
    if not fs.exists(path):
        raise ReportError(f"The run at {run_uri} has no metrics yet: {uri} does not exist.")
    with fs.open(path, "r") as handle:
        try:  # a live run may be writing its last line: the report covers the steps logged whole
            records = whole_lines(handle.read(), source=uri)
        except ValueError as error:
            raise ReportError(f"The run at {run_uri} has damaged metrics: {error}") from None
    by_step = {record["step"]: record for record in records}
    if not by_step:
        raise ReportError(f"The run at {run_uri} has no metrics yet: {uri} holds no step.")
    return [by_step[step] for step in sorted(by_step)]


def series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, over the steps that logged it with a finite value."""
    points = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    points = [(step, value) for step, value in points if math.isfinite(value)]
    return [step for step, _ in points], [value for _, value in points]


def matching_keys(records: Records, patterns: tuple[str, ...]) -> list[str]:
    """The logged keys that match ``patterns``, in the patterns' order, each with at least one value."""
    logged = sorted({key for record in records for key in record})
    found = []
    for pattern in patterns:
        found += [key for key in fnmatch.filter(logged, pattern) if key not in found and series(records, key)[0]]
    return found


def draw_panel(panel: Panel, records: Records) -> bytes | None:
    """The panel as PNG bytes, or None when the run logged none of its keys."""
    figure = panel_figure(panel, records)
    return None if figure is None else png_of(figure)


def panel_figure(panel: Panel, records: Records) -> Figure | None:
    """The panel's figure, one subplot per group of logged keys; None when the run logged none of them."""
    subplots = [keys for patterns in panel.subplots if (keys := matching_keys(records, patterns))]
    if not subplots:
        return None
    figure = Figure(figsize=(7, 2.6 * len(subplots) + 0.6), layout="constrained")
    FigureCanvasAgg(figure)  # explicit Agg canvas: no pyplot, no global backend switch in the caller's process
    figure.suptitle(panel.title)
    for index, (axes, keys) in enumerate(zip(figure.subplots(len(subplots), 1, squeeze=False)[:, 0], subplots)):
        if panel.stacked:
            draw_stacked(axes, records, keys)
        else:
            for key in keys:
                steps, values = series(records, key)
                # Markers keep a run of one or two logged steps visible.
                axes.plot(steps, values, label=key, marker="o" if len(steps) < 30 else None, markersize=3)
        if index == 0 and panel.band:
            draw_band(axes, records, panel.band)
        axes.set_xlabel("step")
        axes.set_ylabel(panel.ylabel)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return figure


def png_of(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def draw_stacked(axes, records: Records, keys: list[str]) -> None:
    """Each step's parts, stacked; a part a step did not log counts 0 there."""
    rows = [r for r in records if any(isinstance(r.get(k), (int, float)) for k in keys)]
    steps = [r["step"] for r in rows]
    layers = [[float(r.get(key, 0.0)) for r in rows] for key in keys]
    axes.stackplot(steps, layers, labels=[key.removeprefix(GOODPUT_PREFIX) for key in keys])


def draw_band(axes, records: Records, band: tuple[str, str]) -> None:
    low_key, high_key = band
    rows = [r for r in records if all(isinstance(r.get(k), (int, float)) for k in band)]
    if rows:
        axes.fill_between([r["step"] for r in rows], [r[low_key] for r in rows], [r[high_key] for r in rows],
                          alpha=0.2, label="min-max")


def headline_figures(records: Records) -> dict[str, Any]:
    """The run at a glance; a figure whose metrics the run did not log is left out.

    ``steps`` is the last step logged (step 0 is the initial evaluation); ``trained_tokens_per_s`` is
    every trained token over the summed step time.
    """
    figures: dict[str, Any] = {"steps": records[-1]["step"]}
    for name, key in (("reward", "response/rewards/mean"), ("eval_accuracy", "eval/accuracy")):
        _, values = series(records, key)
        if values:
            figures[f"{name}_first"], figures[f"{name}_last"] = values[0], values[-1]
    _, step_times = series(records, "time/step")
    if step_times:
        figures["mean_step_s"] = sum(step_times) / len(step_times)
        tokens = sum(series(records, "response/training_tokens")[1])
        if tokens:
            figures["trained_tokens_per_s"] = tokens / sum(step_times)
    goodput = run_goodput({r["step"]: r for r in records})
    if goodput is not None:
        figures["goodput_percent"] = goodput
    return figures


def headline_rows(headline: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) rows of the headline figures, in HEADLINE_LABELS' order."""
    rows = []
    for name, label in HEADLINE_LABELS.items():
        if f"{name}_first" in headline:
            rows.append((label, f"{headline[f'{name}_first']:.3f} → {headline[f'{name}_last']:.3f}"))
        elif name in headline:
            rows.append((label, format_figure(headline[name])))
    return rows


def format_figure(value: int | float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def render_html(run_uri: str, headline: dict[str, Any], pngs: dict[str, bytes], pictures: str = "") -> str:
    """``pictures``: the section of prompt images (``engine.storage.report_samples``), if any."""
    name = html.escape(run_uri.rsplit("/", 1)[-1])
    table = "\n".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(text)}</td></tr>" for label, text in headline_rows(headline)
    )
    figures = "\n".join(
        f'<figure id="{panel}"><img alt="{panel}" src="data:image/png;base64,{base64.b64encode(png).decode()}"></figure>'
        for panel, png in pngs.items()
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{name} - trellis run report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.8em; text-align: left; }}
figure {{ margin: 0 0 1.5em 0; }}
img {{ max-width: 100%; }}
.samples {{ display: flex; flex-wrap: wrap; gap: 1em; }}
.sample {{ border: 1px solid #ccc; padding: 0.5em; width: 16em; }}
.thumb {{ image-rendering: pixelated; width: 128px; }}
</style>
</head>
<body>
<h1>{name}</h1>
<p>{html.escape(run_uri)}</p>
<table>
{table}
</table>
{figures}
{pictures}
</body>
</html>
"""
