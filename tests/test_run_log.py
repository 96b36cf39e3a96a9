"""A run's own text log and what the console shows beside its progress bar; artifact links that a
browser opens. Tried as a user meets it: a dataset with 5 broken rows of 405 and a reward function that
raises on some samples, trained from a project folder with `trellis train --in-process`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import fsspec
import yaml

from trellis.engine.config.loading import load_config
from trellis.engine.run.run_log import RunLog, console_lines, read_run_log
from trellis.engine.storage.store import Store
from trellis.engine.tiny.reverse_task import make_rows
from helpers import moto_s3_server
from trellis.tasks.artifacts import console_link, storage_link

ROOT = Path(__file__).resolve().parents[1]
TRELLIS = str(Path(sys.executable).with_name("trellis"))

FLAKY_REWARD = '''
def score(sample):
    if len(sample["label"]) == 3:
        raise ValueError("three-letter words are not scored")
    return 1.0 if sample["response"].strip() == sample["label"] else 0.0
'''


def test_the_console_and_the_run_log_say_what_was_skipped_and_what_failed(tmp_path, tiny_model):
    rows = [json.dumps(row) for row in make_rows(400, seed=3)]
    broken = ["{not json", json.dumps({"label": "no prompt"}), json.dumps({"prompt": 7, "label": "x"}),
              json.dumps(["a", "list"]), json.dumps({"prompt": "reverse " + "Q" * 300, "label": "x"})]
    (tmp_path / "prompts.jsonl").write_text("\n".join(rows[:200] + broken + rows[200:]) + "\n")
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    config = yaml.safe_load((ROOT / "configs" / "tiny_reverse.yaml").read_text())
    config.update(
        load_from=str(tiny_model), train_dataset={"path": "prompts.jsonl", "max_prompt_length": 64}, eval_dataset=None,
        enable_evaluate=False, enable_initial_evaluate=False, work_dir="runs", experiment_name="noisy", total_train_steps=2,
        checkpoint_interval=-1, hf_interval=-1, auto_resume=False, exp_tracker="jsonl", log_dir="elsewhere/logs",
        reward={"function": "flaky.py:score"},
    )
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([TRELLIS, "train", "my.yaml", "--in-process"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")})
    assert done.returncode == 0, done.stderr[-3000:]

    assert "warning: train prompts: 405 rows read, 400 usable, skipped: 1 invalid JSON" in done.stdout
    assert "warning: step 1:" in done.stdout and "sample(s) failed" in done.stdout
    assert f"run log:      {tmp_path / 'elsewhere' / 'logs'}/run.log" in done.stdout
    log = (tmp_path / "elsewhere" / "logs" / "run.log").read_text()
    assert not (tmp_path / "runs" / "noisy" / "logs" / "run.log").exists()  # log_dir moved it
    steps = [line for line in log.splitlines() if " STEP " in line]
    assert [line.split(" STEP ")[1].split("  ")[0] for line in steps] == ["step 1/2", "step 2/2"]
    assert "reward" in steps[0] and "tokens/s" in steps[0]
    failed = json.loads((tmp_path / "runs" / "noisy" / "logs" / "metrics.jsonl").read_text().splitlines()[0])["rollout/failed_samples"]
    assert failed > 0 and f"step 1: {int(failed)} sample(s) failed" in log


def test_the_run_log_on_object_storage_keeps_every_process_lines():
    with moto_s3_server() as endpoint:
        options = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
        fsspec.filesystem("s3", **options).mkdir("logs-bucket")
        first, second = RunLog(Store("s3://logs-bucket/run/logs", options)), RunLog(Store("s3://logs-bucket/run/logs", options))
        first.info("run r: a fresh start, 2 steps")
        first.step("step 1/2  reward 0.5")
        second.warning("step 2: 3 sample(s) failed")  # a second process (a retried flow run) appends, not replaces
        text = read_run_log(Store("s3://logs-bucket/run/logs/run.log", options))
    assert [line.split(" ", 3)[2] for line in text.splitlines()] == ["INFO", "STEP", "WARNING"]
    assert console_lines(text) == ["run r: a fresh start, 2 steps", "warning: step 2: 3 sample(s) failed"]


def test_artifact_links_open_s3_objects_in_a_browser(tiny_model, reverse_data):
    assert console_link("s3://b/runs/r/checkpoints/step-000002") == (
        "https://s3.console.aws.amazon.com/s3/buckets/b?prefix=runs/r/checkpoints/step-000002/"
    )
    assert console_link("s3://b/runs/r/trajectories/split=train/step=000001/part-0.parquet") == (
        "https://s3.console.aws.amazon.com/s3/object/b?prefix=runs/r/trajectories/split%3Dtrain/step%3D000001/part-0.parquet"
    )
    with moto_s3_server() as endpoint:
        options = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
        fs = fsspec.filesystem("s3", **options)
        fs.mkdir("art")
        fs.pipe("art/run/part-0.parquet", b"parquet bytes")
        base = dict(load_from=str(tiny_model), train_dataset={"path": str(reverse_data["train"])}, work_dir="s3://art",
                    storage_options=options)
        presigned = load_config("configs/tiny_reverse.yaml", **base, artifact_links="presigned", artifact_link_expiry_s=600)
        link = storage_link(presigned, "s3://art/run/part-0.parquet")
        assert link.startswith(endpoint) and "Signature" in link and "k" not in link.split("?")[0].split("/")[-1]
        with urllib.request.urlopen(link) as response:  # what a browser gets, with no credentials of its own
            assert response.read() == b"parquet bytes"
        assert storage_link(presigned, "s3://art/run").startswith("https://s3.console.aws.amazon.com/")  # a folder
        plain = load_config("configs/tiny_reverse.yaml", **base)
        assert storage_link(plain, "s3://art/run/part-0.parquet") == "s3://art/run/part-0.parquet"
        assert storage_link(presigned, "/local/path") == "/local/path"
