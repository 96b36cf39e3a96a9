"""Whole runs of a vision-language policy (issue 34) on the tiny Qwen2-VL and the shapes task: the
colocated trainer as Prefect flow runs on the live Ray cluster (images in the lake as references,
weights synced vision tower included, evaluation, the HF export with its processor, the report's
pictures, `trajectories show`), and the disaggregated trainer with its replay buffer in process."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from trellis.engine.config.loading import load_config
from trellis.engine.run.local import LocalRun
from trellis.engine.storage.lake_query import show_step
from trellis.engine.storage.runs import RunRef
from trellis.engine.storage.report import write_report
from trellis.engine.storage.store import Store
from trellis.engine.tiny import shapes_task
from trellis.engine.tiny.vlm import save_tiny_vlm
from trellis.flows.rl_train import rl_train
from helpers import lake_rows, logged_metrics, run_local

ROOT = Path(__file__).resolve().parents[1]
IMAGE_TOKENS = 9  # an 84 x 84 picture: a 6 x 6 patch grid, merged 2 x 2


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {
        "model": save_tiny_vlm(root / "model", seed=2),  # random weights: these runs test the plumbing, not learning
        "train": shapes_task.write_dataset(root / "train.parquet", 256, seed=0),
        "eval": shapes_task.write_dataset(root / "eval.parquet", 64, seed=shapes_task.EVAL_SEED_OFFSET),
    }


def _config(shapes, work_dir, **changes):
    base = dict(
        load_from=str(shapes["model"]),
        train_dataset={"path": str(shapes["train"])},
        eval_dataset={"path": str(shapes["eval"]), "limit": 8},
        work_dir=str(work_dir),
        train_batch_size=4,
        prompt_repeat_k=4,
        total_train_steps=2,
        evaluate_step=2,
        checkpoint_interval=2,
        hf_interval=2,
        auto_resume=False,
        exp_tracker="jsonl",
    )
    return load_config(ROOT / "configs" / "tiny_shapes.yaml", **{**base, **changes})


def _metrics(config) -> list[dict]:
    return [json.loads(line) for line in (Path(config.run_uri) / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_a_colocated_vision_run_as_flow_runs(shapes, tmp_path, ray_cluster, prefect_api, monkeypatch):
    """Launched from a user's project folder, whose reward module reaches the workers and sees each
    prompt's image part (a reference to the picture)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "picture_reward.py").write_text(
        "def score(sample):\n"
        "    image = sample['prompt'][0]['content'][0]\n"
        "    return 1.0 if image['type'] == 'image' and image['image'].startswith('sha256:') else 0.0\n"
    )
    monkeypatch.chdir(project)
    config = _config(
        shapes, tmp_path, experiment_name="shapes_flow", cluster={"address": ray_cluster["address"]},
        reward={"function": "picture_reward:score"},
    )
    rl_train(config)

    rows = ds.dataset(f"{config.run_uri}/trajectories", format="parquet", partitioning="hive").to_table().to_pylist()
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 2 * 4 * 4 and {r["split"] for r in rows} == {"train", "eval"}
    assert {r["reward"] for r in rows} == {1.0}
    images = Path(config.run_uri) / "images"
    for row in rows:
        (cell,) = row["images"]
        assert cell["uri"] == str(images / cell["sha256"]) and cell["bytes"] is None
        assert row["prompt"][0]["content"].startswith("<image>count ")
        assert row["prompt_ids"].count(283) == IMAGE_TOKENS  # the tiny VLM's <|image_pad|>
    assert len(list(images.iterdir())) == len({r["images"][0]["sha256"] for r in rows})
    # Step 2 samples with step 1's weights (synced every step, vision tower included): the trainer
    # recomputes the engine's logprobs of the images' prompts.
    metrics = {m["step"]: m for m in _metrics(config)}
    assert metrics[2]["mismatch/k3_kl"] < 1e-7 and "eval/accuracy" in metrics[2]
    export = Path(config.run_uri) / "hf" / "step-000002"
    assert AutoImageProcessor.from_pretrained(export).merge_size == 2
    AutoModelForImageTextToText.from_pretrained(export)

    page = Path(write_report(Store(config.run_uri)).html_uri.removeprefix("file://")).read_text()
    assert "What the policy saw at step 2" in page and page.count('class="thumb"') == 4
    shown = show_step(RunRef(config.run_uri), 2, limit=2)
    assert shown and all(s["images"] and s["images"][0].startswith(str(images)) for s in shown)


def test_a_disaggregated_vision_run_in_process(shapes, tmp_path):
    config = _config(
        shapes, tmp_path, experiment_name="shapes_async", trainer="disaggregated",
        replay_buffer={"kind": "async", "max_staleness": 1, "enable_partial_rollout": True},
        enable_initial_evaluate=False, hf_interval=-1,
    )
    with LocalRun(config) as run:
        reports = run.run()
    assert [r.step for r in reports] == [1, 2]
    rows = ds.dataset(f"{config.run_uri}/trajectories/split=train", format="parquet", partitioning="hive").to_table().to_pylist()
    assert len(rows) == 2 * 4 * 4 and all(r["images"] and r["prompt_ids"].count(283) == IMAGE_TOKENS for r in rows)
    assert all(m["mismatch/k3_kl"] < 1e-7 for m in _metrics(config) if "mismatch/k3_kl" in m)


def test_an_interrupted_vision_run_resumes_to_the_same_rows_and_metrics(shapes, tmp_path):
    settings = dict(total_train_steps=4, checkpoint_interval=2, hf_interval=-1, enable_initial_evaluate=False)
    whole = _config(shapes, tmp_path, experiment_name="whole", **settings)
    run_local(whole)
    broken = _config(shapes, tmp_path, experiment_name="broken", **settings)
    run_local(broken, steps=3)  # the latest checkpoint is step 2's
    assert run_local(broken, resume=True).plan.start.step == 2
    assert _rows(broken) == _rows(whole) and len(_rows(whole)) == 4 * 4 * 4
    assert logged_metrics(broken) == logged_metrics(whole)


def _rows(config) -> list[dict]:
    """The lake's rows with each image named by its hash alone (its URI names the run's own folder)."""
    rows = lake_rows(config)
    for row in rows:
        row["images"] = [cell["sha256"] for cell in row["images"]]
    return rows


def test_debug_replay_of_a_vision_step_reads_its_images_back_from_the_lake(shapes, tmp_path):
    """The replayed step trains on pictures read from {run}/images: its fit metrics are the original's."""
    settings = dict(checkpoint_interval=-1, hf_interval=-1, enable_initial_evaluate=False, enable_evaluate=False)
    original = _config(shapes, tmp_path, experiment_name="original", total_train_steps=1, **settings)
    run_local(original)
    lake = str(tmp_path / "rollouts")
    run_local(_config(shapes, tmp_path, experiment_name="rollout_only", total_train_steps=1, debug_rollout=True, debug_rollout_dir=lake, **settings))
    replay = _config(shapes, tmp_path, experiment_name="replay", total_train_steps=None, debug_train=True, debug_rollout_dir=lake, **settings)
    assert run_local(replay).step == 1
    want, got = logged_metrics(original)[1], logged_metrics(replay)[1]
    for key in ("train/pg_loss", "train/grad_norm", "train/entropy", "mismatch/k3_kl"):
        assert got[key] == want[key], key
