"""`trellis report`: the plots and the HTML page of a real (in-process, three-step) run, locally and on
S3, and the clear errors for runs that have nothing to report."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import fsspec
import pytest
import typer
from typer.testing import CliRunner

from trellis.deployments.cli_report import report
from trellis.engine.run.local import LocalRun
from trellis.engine.storage.report import PANELS, ReportError, panel_figure, png_of, write_report
from trellis.engine.storage.store import Store
from helpers import moto_s3_server, tiny_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLOCATED_PANELS = {"reward", "eval", "response_length", "throughput", "mismatch", "goodput"}


@pytest.fixture(scope="module")
def run_folder(tiny_model, reverse_data, tmp_path_factory) -> Path:
    """Three trained steps, evaluated at steps 0 and 3 with pass@4."""
    config = tiny_config(
        tiny_model, reverse_data, tmp_path_factory.mktemp("work"), experiment_name="reported",
        total_train_steps=3, evaluate_step=3, checkpoint_interval=-1,
        rollout={"temperature": 0.6, "max_new_tokens": 8, "eval_samples_per_prompt": 4, "eval_temperature": 0.6},
    )
    with LocalRun(config) as run:
        run.run()
    return Path(config.run_uri)


def metrics_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]


# What each panel must show, written out here rather than read from the product's PANELS:
# (title, y label, the metric keys of each subplot, the (low, high) keys shaded in the first subplot).
SHOWN = {
    "reward": ("Reward", "reward", [["response/rewards/mean"]], ("response/rewards/min", "response/rewards/max")),
    "eval": ("Held-out evaluation", "accuracy", [["eval/accuracy", "eval/pass@4"]], None),
    "response_length": ("Response length", "tokens", [["response/response_len/mean"]],
                        ("response/response_len/min", "response/response_len/max")),
    "throughput": ("Throughput (tokens/s per device)", "tokens/s", None, None),  # keys: the run's throughput/*_tgs
    "mismatch": ("Rollout vs trainer logprob mismatch", "",
                 [["mismatch/abs_logprob_diff", "mismatch/abs_logprob_diff_max"], ["mismatch/k3_kl"]], None),
    "staleness": ("Staleness of trained samples (steps)", "steps", [["async/staleness_mean", "async/staleness_max"]], None),
    # stacked: no lines; the legend names the parts, the first part's area is the "band" (from 0)
    "goodput": ("Where each step's device-seconds went (goodput)", "device-seconds", "stacked", None),
}


def points(records: list[dict], key: str) -> list[tuple[float, float]]:
    return [(float(r["step"]), float(r[key])) for r in records if key in r]


def expected_view(name: str, records: list[dict]) -> dict:
    """What panel ``name`` must show for ``records``: each line the metric's logged (step, value) points."""
    title, ylabel, subplots, band = SHOWN[name]
    if subplots == "stacked":
        parts = sorted({k for r in records for k in r if k.startswith("goodput/device_s/")})
        first = points(records, parts[0])
        return {"title": title, "subplots": [{
            "xlabel": "step", "ylabel": ylabel, "lines": {}, "legend": [k.removeprefix("goodput/device_s/") for k in parts],
            "band": {(step, 0.0) for step, _ in first} | set(first),
        }]}
    if subplots is None:
        subplots = [sorted({k for r in records for k in r if k.startswith("throughput/") and k.endswith("_tgs")})]
    subplots = [logged for keys in subplots if (logged := [key for key in keys if points(records, key)])]
    view = {"title": title, "subplots": []}
    for index, keys in enumerate(subplots):
        shaded = band if index == 0 else None
        view["subplots"].append({
            "xlabel": "step", "ylabel": ylabel,
            "lines": {key: points(records, key) for key in keys},
            "legend": keys + (["min-max"] if shaded else []),
            "band": set(points(records, shaded[0])) | set(points(records, shaded[1])) if shaded else None,
        })
    return view


def shown(figure) -> dict:
    """What a figure shows, read back from it: its title, and per subplot the axis labels, every line's
    label and points, the legend, and the corners of the shaded band."""
    view = {"title": figure.get_suptitle(), "subplots": []}
    for axes in figure.axes:
        bands = [{tuple(map(float, v)) for v in c.get_paths()[0].vertices} for c in axes.collections]
        view["subplots"].append({
            "xlabel": axes.get_xlabel(), "ylabel": axes.get_ylabel(),
            "lines": {
                line.get_label(): [(float(x), float(y)) for x, y in zip(line.get_xdata(), line.get_ydata())]
                for line in axes.get_lines()
            },
            "legend": [text.get_text() for text in axes.get_legend().get_texts()],
            "band": bands[0] if bands else None,
        })
    return view


def assert_plot(png: bytes, name: str, records: list[dict]) -> None:
    """The PNG shows panel ``name`` of ``records``: the panel's figure holds exactly the expected
    lines, labels and band, and the PNG is that figure rendered, byte for byte."""
    assert png.startswith(PNG_SIGNATURE)
    figure = panel_figure(next(p for p in PANELS if p.name == name), records)
    assert shown(figure) == expected_view(name, records), name
    assert png == png_of(figure), f"{name}.png is not the rendering of the checked figure"


def cli() -> typer.Typer:
    """A stand-in for the trellis app; its callback keeps ``report`` a subcommand, as it is there."""
    app = typer.Typer()
    app.callback()(lambda: None)
    app.command("report")(report)
    return app


def test_the_report_plots_each_logged_panel_and_embeds_them_in_one_html_page(run_folder, tmp_path):
    """Each panel plots the metrics.jsonl series it names, at their steps. Tried: plotting every line of
    a subplot with its first key's series, and drawing the panels from all records but the first
    (``records[1:]`` in ``write_report``): both fail here."""
    written = write_report(Store(str(run_folder)), str(tmp_path / "out"))

    assert set(written.png_uris) == COLOCATED_PANELS  # no staleness panel: the run is colocated
    page = Path(written.html_uri).read_text()
    records = metrics_of(run_folder)
    assert len(points(records, "response/rewards/mean")) == 3 and len(points(records, "eval/accuracy")) == 2
    for panel, uri in written.png_uris.items():
        png = Path(uri).read_bytes()
        assert_plot(png, panel, records)
        assert f'src="data:image/png;base64,{base64.b64encode(png).decode()}"' in page, panel
    assert "reported" in page and "Eval accuracy" in page


def test_the_default_output_is_the_run_folder_s_report_folder(run_folder):
    written = write_report(Store(str(run_folder)))
    assert written.html_uri == f"{run_folder}/report/index.html" and Path(written.html_uri).is_file()
    assert written.png_uris["reward"] == f"{run_folder}/report/reward.png"


def test_the_headline_figures_are_the_metrics_file_s(run_folder, tmp_path):
    records = metrics_of(run_folder)
    trained = [r for r in records if "time/step" in r]
    evaluated = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 3] and "eval/pass@4" in evaluated[-1]

    headline = write_report(Store(str(run_folder)), str(tmp_path)).headline

    assert headline["steps"] == 3
    assert headline["reward_first"] == trained[0]["response/rewards/mean"]
    assert headline["reward_last"] == trained[-1]["response/rewards/mean"]
    assert headline["eval_accuracy_first"] == evaluated[0]["eval/accuracy"]
    assert headline["eval_accuracy_last"] == evaluated[-1]["eval/accuracy"]
    assert headline["mean_step_s"] == pytest.approx(sum(r["time/step"] for r in trained) / 3)
    assert headline["trained_tokens_per_s"] == pytest.approx(
        sum(r["response/training_tokens"] for r in trained) / sum(r["time/step"] for r in trained)
    )


def test_the_markdown_summary_has_the_headline_and_links_the_page(run_folder, tmp_path):
    written = write_report(Store(str(run_folder)), str(tmp_path))
    summary = written.markdown()
    assert "| Steps | 3 |" in summary
    assert f"{written.headline['reward_first']:.3f} → {written.headline['reward_last']:.3f}" in summary
    assert f"]({written.html_uri})" in summary


def test_an_asynchronous_run_s_staleness_gets_its_panel(run_folder, tmp_path):
    run = tmp_path / "async_run"
    (run / "logs").mkdir(parents=True)
    records = metrics_of(run_folder)
    for record in records[1:]:
        record.update({"async/staleness_mean": 0.5 * record["step"], "async/staleness_max": 1.0})
    (run / "logs" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")

    written = write_report(Store(str(run)))

    assert set(written.png_uris) == COLOCATED_PANELS | {"staleness"}
    assert_plot(Path(written.png_uris["staleness"]).read_bytes(), "staleness", records)
    assert points(records, "async/staleness_mean") == [(1.0, 0.5), (2.0, 1.0), (3.0, 1.5)]


def test_a_panel_without_its_metrics_is_left_out_instead_of_drawn_empty(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.4}) + "\n")
    written = write_report(Store(str(tmp_path)))
    assert set(written.png_uris) == {"eval"} and written.headline == {
        "steps": 0, "eval_accuracy_first": 0.4, "eval_accuracy_last": 0.4,
    }
    assert_plot(Path(written.png_uris["eval"]).read_bytes(), "eval", [{"step": 0, "eval/accuracy": 0.4}])


def test_a_run_without_metrics_is_a_clear_error(tmp_path):
    (tmp_path / "logs").mkdir()
    with pytest.raises(ReportError, match="has no metrics yet: .*metrics.jsonl does not exist"):
        write_report(Store(str(tmp_path)))
    (tmp_path / "logs" / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError, match="has no metrics yet: .*holds no step"):
        write_report(Store(str(tmp_path)))

    result = CliRunner().invoke(cli(), ["report", str(tmp_path)])
    assert result.exit_code == 2 and "has no metrics yet" in result.stderr


def test_a_live_run_s_half_written_line_waits_and_a_damaged_line_is_named(run_folder, tmp_path):
    """A report of a run that is writing its metrics: its last line cut short (as a writer that writes in
    place leaves it) is left out, the steps before it reported; a whole line that is not JSON is an error that
    names the line. Tried: the same file read with json.loads per line raised JSONDecodeError."""
    lines = (run_folder / "logs" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "logs").mkdir()
    live = tmp_path / "logs" / "metrics.jsonl"
    live.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    written = write_report(Store(str(tmp_path)))
    assert written.headline["steps"] == json.loads(lines[-2])["step"]

    live.write_text(lines[0] + "\n" + lines[1][:-3] + "\n" + lines[2] + "\n")
    with pytest.raises(ReportError, match=r"damaged metrics: .*metrics.jsonl line 2 is not JSON"):
        write_report(Store(str(tmp_path)))


def test_the_cli_prints_where_it_wrote_and_refuses_an_unknown_run(run_folder, tmp_path):
    runner = CliRunner()
    work_dir = str(run_folder.parent)
    result = runner.invoke(cli(), ["report", "reported", "--work-dir", work_dir, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"report: {tmp_path}/index.html" in result.stdout and f"reward: {tmp_path}/reward.png" in result.stdout

    result = runner.invoke(cli(), ["report", "nope", "--work-dir", work_dir])
    assert result.exit_code == 2
    assert f"No run named 'nope' under {work_dir}. Runs there: reported." in result.stderr


def test_a_report_of_a_run_on_s3_is_written_to_s3(run_folder, tmp_path):
    local = tmp_path / "run"
    shutil.copytree(run_folder, local, ignore=shutil.ignore_patterns("report"))
    with moto_s3_server() as endpoint:
        storage = {"key": "k", "secret": "s", "endpoint_url": endpoint}
        s3 = fsspec.filesystem("s3", **storage)
        s3.mkdir("reports")
        s3.put(f"{local}/", "reports/runs/reported/", recursive=True)

        written = write_report(Store("s3://reports/runs/reported", storage))

        assert written.html_uri == "s3://reports/runs/reported/report/index.html"
        assert set(written.png_uris) == COLOCATED_PANELS
        page = s3.cat(written.html_uri).decode()
        for panel, uri in written.png_uris.items():
            png = s3.cat(uri)
            assert_plot(png, panel, metrics_of(run_folder))
            assert base64.b64encode(png).decode() in page
