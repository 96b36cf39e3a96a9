"""The command line as a new user meets it: clear messages and non-zero exits, no tracebacks."""

import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from trellis.deployments.progress import RunLogTail, follow_metrics
from trellis.engine.config.loading import load_config


# A bound for a hung command, not a speed bar: on 2 busy cores `tiny-model` and a 2-step run each took
# ~120 s, where a bound of 120 s failed them.
COMMAND_TIMEOUT_S = 900


def trellis(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "trellis.deployments.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=COMMAND_TIMEOUT_S)


def test_unknown_key_and_negative_interval_are_reported_without_traceback(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("load_from: m\ntrain_dataset: {path: d}\ntotal_train_steps: 3\ntrain_batch_sise: 4\ncheckpoint_interval: -3\n")
    result = trellis("train", str(config))
    assert result.returncode == 2
    assert "did you mean 'train_batch_size'" in result.stderr
    assert "checkpoint_interval must be positive, or -1 / null to disable it; got -3" in result.stderr  # not hidden
    assert "Traceback" not in result.stderr


def test_missing_model_path_is_reported_before_anything_starts(tmp_path, reverse_data):
    config = tmp_path / "run.yaml"
    config.write_text(f"load_from: {tmp_path}/no-model\ntrain_dataset: {{path: {reverse_data['train']}}}\ntotal_train_steps: 3\n"
                      "reward: {function: 'trellis.engine.tiny.reverse_task:score'}\n")
    result = trellis("train", str(config))
    assert result.returncode == 2
    assert f"load_from: {tmp_path}/no-model does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_tiny_model_then_train_through_the_flow(tmp_path, ray_cluster):
    built = trellis("tiny-model", str(tmp_path / "tiny"), "--data", str(tmp_path / "data"))
    assert built.returncode == 0, built.stderr
    result = trellis(
        "train", "configs/tiny_reverse.yaml",
        "--set", f"load_from={tmp_path}/tiny",
        "--set", f"train_dataset.path={tmp_path}/data/train.parquet",
        "--set", f"eval_dataset.path={tmp_path}/data/eval.parquet",
        "--set", f"work_dir={tmp_path}/runs",
        "--set", "total_train_steps=2", "--set", "evaluate_step=1", "--set", "eval_dataset.limit=32",
        "--set", f"cluster.address={ray_cluster['address']}", "--set", f"cluster.home={ray_cluster['home']}",
    )
    assert result.returncode == 0, result.stderr
    assert "eval accuracy" in result.stdout
    assert f"trajectories: {tmp_path}/runs/tiny_reverse/trajectories" in result.stdout
    assert (tmp_path / "runs" / "tiny_reverse" / "trajectories" / "split=train" / "step=000002" / "part-0.parquet").exists()
    assert (tmp_path / "runs" / "tiny_reverse" / "logs" / "metrics.jsonl").exists()
    assert "Traceback" not in result.stderr


def test_in_process_training_needs_no_cluster(tmp_path, tiny_model, reverse_data):
    result = trellis(
        "train", "configs/tiny_reverse.yaml", "--in-process",
        "--set", f"load_from={tiny_model}",
        "--set", f"train_dataset.path={reverse_data['train']}",
        "--set", f"eval_dataset.path={reverse_data['eval']}",
        "--set", f"work_dir={tmp_path}/runs",
        "--set", "total_train_steps=2", "--set", "evaluate_step=1", "--set", "eval_dataset.limit=32",
    )
    assert result.returncode == 0, result.stderr
    assert "eval accuracy" in result.stdout


def test_a_run_sized_in_epochs_shows_its_total_steps(tmp_path, tiny_model, ray_cluster):
    """total_epochs instead of total_train_steps: the progress bar's total comes from the run plan
    (32 prompts, 16 a step, 1 epoch: 2 steps), not from the unset total_train_steps."""
    from trellis.engine.tiny.reverse_task import write_dataset

    data = write_dataset(tmp_path / "small.parquet", 32, seed=0)
    result = trellis(
        "train", "configs/tiny_reverse.yaml",
        "--set", f"load_from={tiny_model}", "--set", f"train_dataset.path={data}", "--set", "eval_dataset=null",
        "--set", "enable_evaluate=false", "--set", "enable_initial_evaluate=false",
        "--set", "total_train_steps=null", "--set", "total_epochs=1", "--set", f"work_dir={tmp_path}/runs",
        "--set", f"cluster.address={ray_cluster['address']}", "--set", f"cluster.home={ray_cluster['home']}",
    )
    assert result.returncode == 0, result.stderr
    assert "2/2" in result.stdout and "None" not in result.stdout


BROKEN_REWARDS = {
    "module missing": ("nosuchmodule:score", None, "no module 'nosuchmodule'"),
    "attribute missing": ("myreward:scor", "def score(sample):\n    return 1.0\n", "defines no 'scor'"),
    "raises on import": ("myreward:score", "import json\nraise RuntimeError('the judge model is not downloaded')\n",
                         "importing 'myreward' failed: RuntimeError: the judge model is not downloaded (at "),
    "missing dependency": ("myreward:score", "import judge_sdk\n\ndef score(sample):\n    return 1.0\n",
                           "importing 'myreward' failed: ModuleNotFoundError: No module named 'judge_sdk'"),
    "two parameters": ("myreward:score", "def score(sample, label):\n    return 1.0\n",
                       "has the signature score(sample, label); a reward function takes exactly one argument"),
    "file missing": ("rewards/missing.py:score", None, "rewards/missing.py does not exist"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_REWARDS))
def test_a_broken_reward_function_is_refused_before_any_worker_starts(case, tmp_path, tiny_model, reverse_data):
    """Tried as a new user would, from a project folder of their own: each broken reward module ends
    the run with exit code 2 and one line that names the problem, no traceback, and no cluster started
    (the head record under a fresh cluster.home stays absent)."""
    spec, source, message = BROKEN_REWARDS[case]
    if source is not None:
        (tmp_path / "myreward.py").write_text(source)
    (tmp_path / "my.yaml").write_text(
        f"load_from: {tiny_model}\ntrain_dataset: {{path: {reverse_data['train']}}}\ntotal_train_steps: 2\n"
        f"reward: {{function: '{spec}'}}\ncluster: {{home: {tmp_path / 'home'}}}\n"
    )
    result = subprocess.run([str(Path(sys.executable).with_name("trellis")), "train", "my.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert not (tmp_path / "home" / "ray-head.json").exists()


def test_the_progress_bar_reads_a_plan_and_metrics_being_written_without_dying(tmp_path, tiny_model, reverse_data):
    """Tried: the run plan read while a retried run rewrites it (empty, then half of it), and metrics.jsonl
    read with its last line half-written. Before: the progress thread of `trellis train` died on a
    JSONDecodeError and printed its traceback under the run's own lines (CI at 32b430e, the trainer-killed
    test with a flow retry). Now the bar shows what is whole and reads the rest at its next tick."""
    config = load_config("configs/tiny_reverse.yaml", load_from=str(tiny_model), work_dir=str(tmp_path),
                         train_dataset={"path": str(reverse_data["train"])}, eval_dataset={"path": str(reverse_data["eval"])})
    logs = Path(config.run_uri) / "logs"
    logs.mkdir(parents=True)
    plan, metrics = logs / "run_plan.json", logs / "metrics.jsonl"
    plan.write_text("")
    step_1 = json.dumps({"step": 1, "response/rewards/mean": 0.25})
    metrics.write_text(step_1 + "\n" + '{"step": 2, "response/rew')
    bar, done = tqdm(total=None, file=io.StringIO()), threading.Event()
    follower = threading.Thread(target=follow_metrics, args=(config, bar, done, RunLogTail(config), 0.01), daemon=True)
    follower.start()

    def shows(total, n) -> bool:
        for _ in range(300):
            if (bar.total, bar.n) == (total, n):
                return True
            time.sleep(0.01)
        return False

    assert shows(None, 1) and follower.is_alive()
    plan.write_text('{"total_steps": 6, "start": {"st')
    time.sleep(0.1)
    assert follower.is_alive() and bar.total is None
    plan.write_text(json.dumps({"total_steps": 6, "start": {"step": 0}}))
    metrics.write_text(step_1 + "\n" + json.dumps({"step": 2, "response/rewards/mean": 0.5}) + "\n")
    assert shows(6, 2) and follower.is_alive()
    done.set()
    follower.join(timeout=5)
    assert not follower.is_alive()
