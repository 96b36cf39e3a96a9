"""Metrics in the trackers users browse: MLflow against a real local tracking server, read back through
MLflow's client, and W&B in offline mode; a resumed run goes on in the same tracker runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from trellis.engine.errors import SettingError
from helpers import logged_metrics, run_local as run, tiny_config

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")
from mlflow.tracking import MlflowClient  # noqa: E402

pytestmark = pytest.mark.slow
SECRET = "s3cr3t-tracker-value-917"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    from conftest import _free_port

    root, port = tmp_path_factory.mktemp("mlflow"), _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "artifacts")],
        stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the MLflow server did not start:\n" + (root / "server.log").read_text()[-3000:]) from None
            time.sleep(0.5)
    yield uri
    server.terminate()
    server.wait(timeout=30)


def test_a_resumed_run_goes_on_in_the_same_mlflow_and_wandb_runs(tiny_model, reverse_data, tmp_path, mlflow_server):
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="tracked", exp_tracker=["jsonl", "mlflow", "wandb"],
        trackers={"mlflow": {"tracking_uri": mlflow_server, "experiment": "trellis-test"}},
        cluster={"runtime_env": {"env_vars": {"PIP_INDEX_URL": f"https://me:{SECRET}@pypi.example.com/simple"}}},
    )
    run(config, steps=3)  # dies after step 3: the latest checkpoint is step 2's
    ids = json.loads((tmp_path / "tracked/logs/trackers.json").read_text())
    run(config, resume=True)  # step 3 again, then 4
    assert json.loads((tmp_path / "tracked/logs/trackers.json").read_text()) == ids

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("trellis-test")
    [mlflow_run] = client.search_runs([experiment.experiment_id])
    assert mlflow_run.info.run_id == ids["mlflow"] and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.info.run_name == "tracked"
    assert mlflow_run.data.tags["trellis.run_uri"] == config.run_uri
    assert mlflow_run.data.tags["trellis.resumed_at_step"] == "3"
    assert mlflow_run.data.params["optim.lr"] == str(config.optim.lr)
    assert mlflow_run.data.params["cluster.runtime_env.env_vars.PIP_INDEX_URL"] == "https://me:**********@pypi.example.com/simple"
    assert not any(SECRET in value for value in mlflow_run.data.params.values())

    logged = logged_metrics(config)
    history = client.get_metric_history(ids["mlflow"], "response/rewards/mean")
    assert sorted({m.step for m in history}) == [1, 2, 3, 4]
    latest = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}  # step 3's later value wins
    assert latest == pytest.approx({step: logged[step]["response/rewards/mean"] for step in (1, 2, 3, 4)})

    wandb_runs = sorted((tmp_path / "tracked/logs/wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert len(wandb_runs) == 2  # one offline folder per run start, the same W&B run id: `wandb sync` merges them
    for folder in wandb_runs:
        assert (folder / f"run-{ids['wandb']}.wandb").stat().st_size > 0
        assert SECRET not in (folder / f"run-{ids['wandb']}.wandb").read_bytes().decode("latin-1")


def test_an_unreachable_mlflow_server_stops_the_run_before_its_first_step(tiny_model, reverse_data, tmp_path, monkeypatch):
    """Tried: a tracking URI where no server listens. The run stops at its start with the URI named."""
    from conftest import _free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    uri = f"http://127.0.0.1:{_free_port()}"
    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="no_server", exp_tracker="mlflow",
                         trackers={"mlflow": {"tracking_uri": uri}})
    with pytest.raises(SettingError, match=f"MLflow at {uri} refused the run"):
        run(config)
    assert not (tmp_path / "no_server/logs/metrics.jsonl").exists()
