"""Look at the Prefect UI as a user would, in a real browser (Debian's headless Chromium; no download):
start a server with `trellis server up`, run the training deployment on the tiny model for a few
steps, then screenshot the deployments page, a step's flow run (its task graph) and the step's
artifacts, and check that each page rendered (not blank, the expected names in its DOM).

    apt-get install chromium
    .venv/bin/trellis tiny-model build/tiny --data build/data
    .venv/bin/python bench/prefect_ui_check.py bench/results/prefect_ui     # PNGs + a JSON summary there
    .venv/bin/python bench/prefect_ui_check.py OUT --guard   # the stability guard's branch: 8 steps, an lr spike at step 6

Exit code 1 if a page did not render as expected.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import typer
import yaml

ROOT = Path(__file__).resolve().parents[1]
TRELLIS = str(Path(sys.executable).with_name("trellis"))


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    raise SystemExit("No Chromium found: apt-get install chromium")


def browse(url: str, out: Path | None = None) -> str:
    """The rendered DOM of ``url`` (and a screenshot into ``out``): the UI is a client-side app, so the
    virtual-time budget lets it load its data first."""
    base = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1600,1000", "--virtual-time-budget=20000"]
    if out is not None:
        subprocess.run([*base, f"--screenshot={out}", url], check=True, capture_output=True, timeout=120)
    return subprocess.run([*base, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120).stdout


def not_blank(png: Path) -> bool:
    from matplotlib.image import imread

    pixels = imread(png)
    return png.stat().st_size > 20_000 and float(pixels.std()) > 0.02


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(
    out: Path = typer.Argument(..., help="Folder for the screenshots and summary.json."),
    steps: int = 3,
    guard: bool = typer.Option(False, help="Run 8 steps with the stability guard and an injected lr spike; show the rolled-back step."),
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    home, work = Path(tempfile.mkdtemp(prefix="trellis-ui-")), Path(tempfile.mkdtemp(prefix="trellis-ui-work-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    port = free_port()
    subprocess.run([TRELLIS, "server", "up", "--home", str(home), "--port", str(port)], env=env, check=True, cwd=ROOT)
    ui = f"http://127.0.0.1:{port}"
    os.environ["PREFECT_API_URL"] = f"{ui}/api"
    try:
        cluster = {"home": str(home), "head_port": free_port()}
        checks = exercise_guard(ui, out, work, cluster) if guard else exercise_ui(ui, out, work, steps, cluster=cluster)
    finally:
        subprocess.run([TRELLIS, "cluster", "down", "--home", str(home)], env=env, cwd=ROOT)
        subprocess.run([TRELLIS, "server", "down", "--home", str(home)], env=env, cwd=ROOT)
    (out / "summary.json").write_text(json.dumps(checks, indent=2))
    for check in checks:
        typer.echo(f"{'ok ' if check['ok'] else 'BAD'} {check['page']}: {check['url']} -> {check['screenshot']}")
    raise typer.Exit(code=0 if all(c["ok"] for c in checks) else 1)


def tiny_run(work: Path, name: str, steps: int, cluster: dict, **changes) -> None:
    """The bundled task through the training deployment, as a user launches it."""
    from prefect.deployments import run_deployment

    config = yaml.safe_load((ROOT / "configs" / "tiny_reverse.yaml").read_text())
    config.update({
        "load_from": str(ROOT / "build" / "tiny"), "work_dir": str(work), "experiment_name": name, "total_train_steps": steps,
        "checkpoint_interval": steps, "evaluate_step": steps, "hf_interval": -1, "enable_initial_evaluate": False, "cluster": cluster,
        **changes,
    })
    config["train_dataset"]["path"] = str(ROOT / "build" / "data" / "train.parquet")
    config["eval_dataset"]["path"] = str(ROOT / "build" / "data" / "eval.parquet")
    flow_run = run_deployment("rl_train/tiny-reverse", parameters={"config": config}, timeout=900)
    assert flow_run.state.is_completed(), flow_run.state


def look_at(pages: list[tuple[str, str, list[str]]], out: Path) -> list[dict]:
    checks = []
    for index, (page, url, expected) in enumerate(pages):
        png = out / f"{index}-{page.split(' ')[0]}.png"
        dom = browse(url, png)
        missing = [text for text in expected if text not in dom]
        checks.append({"page": page, "url": url, "screenshot": str(png), "missing_in_dom": missing,
                       "ok": not missing and not_blank(png)})
    return checks


def exercise_guard(ui: str, out: Path, work: Path, cluster: dict) -> list[dict]:
    """8 steps, checkpoints every 2, one optimizer step at 100x its lr at step 6 (engine.faults): the guard
    trips at step 7 and rolls back to step 4. Shows the tripped step's flow run and the trip's artifact."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter, TaskRunFilter

    from trellis.engine.faults import FAULT_FILE, LR_SPIKE

    marker = work / "fault"
    marker.write_text(f"{LR_SPIKE} 5")
    tiny_run(work, "guard_ui", 8, {**cluster, "runtime_env": {"env_vars": {FAULT_FILE: str(marker)}}}, checkpoint_interval=2,
             guard={"enabled": True})
    with get_client(sync_client=True) as client:
        attempts = client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": ["rl_step[step=7]"]}))
        tripped = next(run for run in attempts if any(
            task.name.startswith("roll_back") for task in client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id={"any_": [run.id]}))))
        page = client.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": ["guard-ui-stability-guard"]}))[0]
    return look_at([
        ("tripped step flow run (task graph)", f"{ui}/runs/flow-run/{tripped.id}", ["rl_step[step=7]", "check_stability[step=7]", "roll_back[step=7]"]),
        ("stability guard artifact", f"{ui}/artifacts/artifact/{page.id}", ["reward_collapse", "Rolled back"]),
    ], out)


def exercise_ui(ui: str, out: Path, work: Path, steps: int, cluster: dict) -> list[dict]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter

    tiny_run(work, "ui_check", steps, cluster)
    with get_client(sync_client=True) as client:
        step_run = client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [f"rl_step[step={steps}]"]}))[0]
        metrics = client.read_artifacts(
            artifact_filter=ArtifactFilter(key={"any_": ["ui-check-step-metrics"]}, flow_run_id={"any_": [step_run.id]})
        )[0]
    pages = [
        ("deployments", f"{ui}/deployments", ["tiny-reverse", "evaluate_checkpoint", "rescore", "export"]),
        ("step flow run (task graph)", f"{ui}/runs/flow-run/{step_run.id}", [f"rl_step[step={steps}]", "fit[step=", "produce_batch[step="]),
        ("step metrics artifact", f"{ui}/artifacts/artifact/{metrics.id}", ["response/rewards/mean", "time/fit"]),
        ("artifact history", f"{ui}/artifacts/key/ui-check-step-metrics", ["ui-check-step-metrics", f"rl_step[step={steps}]"]),
    ]
    return look_at(pages, out)


if __name__ == "__main__":
    typer.run(main)
