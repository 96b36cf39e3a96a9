"""The disaggregated asynchronous trainer as Prefect flow runs on a real Ray cluster: a producer on the
rollout side fills a replay buffer while the trainer trains; staleness stays within its bound; the
per-prompt ledger shows every prompt trained exactly once, also across SIGKILLs of each part."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest
import ray
import yaml

from engine.cluster.workers import RunWorkers
from engine.storage.ledger import EXACTLY_ONCE
from engine.tiny.reverse_task import write_dataset
from flows.rl_train import rl_train
from helpers import logged_metrics, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def async_config(tiny_model, data, tmp_path, ray_cluster, name, **changes):
    base = dict(
        trainer="disaggregated", replay_buffer={"max_staleness": 1}, experiment_name=name,
        enable_evaluate=False, enable_initial_evaluate=False, checkpoint_interval=2, auto_resume=False,
        cluster={"address": ray_cluster["address"]}, train_dataset={"path": str(data), "max_prompt_length": 64},
    )
    return tiny_config(tiny_model, {"train": data, "eval": data}, tmp_path, **{**base, **changes})


def test_the_bundled_task_learns_asynchronously_within_its_staleness_bound(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """max_staleness 1: the producer makes step t+1's batch with the weights of step t-1 while step t
    trains. With the settings of configs/tiny_reverse_async.yaml (lr 2e-4, token-level rollout IS),
    held-out greedy accuracy rises from ~0.38 to >= 0.75 in 60 steps; no trained token is staler than
    the bound; the ledger holds every drawn prompt once."""
    config = async_config(
        tiny_model, reverse_data["train"], tmp_path, ray_cluster, "async_learns", total_train_steps=60, checkpoint_interval=-1,
        enable_evaluate=True, enable_initial_evaluate=True, evaluate_step=60,
        eval_dataset={"path": str(reverse_data["eval"]), "max_prompt_length": 64},
        optim={"lr": 2e-4}, loss={"rollout_is": {"level": "token"}},
    )
    rl_train(config)
    metrics = logged_metrics(config)
    assert 0.3 <= metrics[0]["eval/accuracy"] <= 0.5 and metrics[60]["eval/accuracy"] >= 0.75, (metrics[0], metrics[60])
    assert all(metrics[step]["async/staleness_max"] <= 1 for step in range(1, 61))
    assert metrics[25]["async/staleness_mean"] == 1.0  # the producer did run a step ahead
    trained = f"{config.run_uri}/trajectories/split=train/*/*.parquet"
    (stalest,) = duckdb.sql(
        f"SELECT max(train_step - version - 1) FROM (SELECT train_step, unnest(response_versions) AS version "
        f"FROM read_parquet('{trained}'))"
    ).fetchall()[0]
    assert stalest == 1
    assert duckdb.sql(EXACTLY_ONCE.format(run=config.run_uri, epoch=0)).fetchall() == []
    (count,) = duckdb.sql(f"SELECT count(*) FROM read_parquet('{config.run_uri}/ledger/*/*.parquet')").fetchall()[0]
    assert count == 60 * 16
    produced = f"{config.run_uri}/produced/*/*.parquet"
    (made,) = duckdb.sql(f"SELECT count(DISTINCT group_id) FROM read_parquet('{produced}')").fetchall()[0]
    assert made >= 60 * 16  # every group entered the lake when scored, trained or not


def ledger_problems(config, epochs: int) -> list:
    """Prompts of the first ``epochs`` epochs trained other than once, and groups trained in part."""
    found = []
    for epoch in range(epochs):
        found += duckdb.sql(EXACTLY_ONCE.format(run=config.run_uri, epoch=epoch)).fetchall()
    ledger = f"read_parquet('{config.run_uri}/ledger/*/*.parquet')"
    found += duckdb.sql(f"SELECT group_id, samples FROM {ledger} WHERE samples != 8").fetchall()
    (trained,) = duckdb.sql(f"SELECT count(DISTINCT (epoch, prompt_index)) FROM {ledger} WHERE epoch < {epochs}").fetchall()[0]
    if trained != 32 * epochs:
        found.append(("prompts trained", trained))
    return found


def kill_when(step_file: Path, pid_of, stop: threading.Event) -> threading.Thread:
    """SIGKILL the process ``pid_of()`` names once ``step_file`` exists."""

    def watch() -> None:
        while not stop.is_set() and not step_file.exists():
            time.sleep(0.02)
        if not stop.is_set():
            os.kill(pid_of(), signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("victim, seed", [("rollout", 1), ("trainer", 2), ("controller", 3)])
def test_a_worker_killed_mid_run_loses_no_prompt_and_trains_none_twice(tiny_model, tmp_path, ray_cluster, prefect_api, victim, seed):
    """32 prompts (2 steps an epoch), 8 steps, checkpoints every 2. The victim is SIGKILLed when a
    randomly chosen step's trajectories land. A lost rollout worker is replaced by the retried task and
    the producer restarts; a lost trainer or controller fails the attempt, whose Prefect retry resumes
    from the last checkpoint. Either way the ledger shows each prompt of epochs 0-3 trained exactly
    once and no group trained in part."""
    data = write_dataset(tmp_path / "small.parquet", 32, seed=0)
    config = async_config(tiny_model, data, tmp_path, ray_cluster, f"kill_{victim}", total_train_steps=8,
                          cluster={"address": ray_cluster["address"], "flow_retries": 2})
    workers = RunWorkers(config)
    at = random.Random(seed).randint(2, 6)
    stop = threading.Event()
    watcher = kill_when(tmp_path / f"kill_{victim}" / "trajectories" / "split=train" / f"step={at:06d}" / "part-0.parquet",
                        lambda: workers.pids()[victim], stop)
    try:
        rl_train(config)
    finally:
        stop.set()
        watcher.join(timeout=5)
    assert ledger_problems(config, epochs=4) == []
    assert sorted(logged_metrics(config)) == list(range(1, 9))


def test_a_flow_process_killed_mid_run_resumes_without_losing_a_prompt(tiny_model, tmp_path, ray_cluster, prefect_api):
    """The flow process (and its temporary Prefect server) SIGKILLed mid-step; `trellis train --resume`
    continues on the live workers from the last checkpoint."""
    data = write_dataset(tmp_path / "small.parquet", 32, seed=0)
    config = async_config(tiny_model, data, tmp_path, ray_cluster, "kill_flow", total_train_steps=8)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    trellis = str(Path(sys.executable).with_name("trellis"))
    flow_process = subprocess.Popen([trellis, "train", str(config_file)], cwd=ROOT, env=env, start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    step_five = tmp_path / "kill_flow" / "trajectories" / "split=train" / "step=000005" / "part-0.parquet"
    deadline = time.time() + 300
    while not step_five.exists():
        assert flow_process.poll() is None and time.time() < deadline, "the flow process ended before it could be killed"
        time.sleep(0.05)
    os.killpg(flow_process.pid, signal.SIGKILL)
    flow_process.wait(timeout=30)
    assert max(logged_metrics(config)) < 8, "the run was not interrupted"
    rl_train(config, resume=True)
    assert ledger_problems(config, epochs=4) == []
    assert sorted(logged_metrics(config)) == list(range(1, 9))


def test_a_rollout_worker_that_dies_on_every_restart_ends_the_run_with_its_cause(tiny_model, tmp_path, ray_cluster, prefect_api):
    data = write_dataset(tmp_path / "small.parquet", 32, seed=0)
    config = async_config(tiny_model, data, tmp_path, ray_cluster, "doomed", total_train_steps=8,
                          cluster={"address": ray_cluster["address"], "flow_retries": 0, "ray_get_timeout_s": 60})
    workers, stop, killed = RunWorkers(config), threading.Event(), []

    def keep_killing() -> None:
        while not stop.is_set():
            try:
                pid = ray.get(workers.actor("rollout").pid.remote(), timeout=5)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except Exception:
                pass
            time.sleep(0.1)

    started = time.monotonic()
    threading.Thread(target=keep_killing, daemon=True).start()
    try:
        with pytest.raises(Exception, match="(?i)rollout|actor died|ActorDied"):
            rl_train(config)
    finally:
        stop.set()
    assert time.monotonic() - started < 240 and len(killed) >= 2
    workers.release()


def test_a_reward_module_the_workers_cannot_import_ends_the_run_with_its_cause(tiny_model, tmp_path, ray_cluster, prefect_api):
    """Tried: a reward module that imports on the driver (so preflight passes) and raises
    ModuleNotFoundError on the workers. The run ends at once with the module's own error, well inside
    ray_get_timeout_s, and trains nothing."""
    data = write_dataset(tmp_path / "small.parquet", 32, seed=0)
    config = async_config(tiny_model, data, tmp_path, ray_cluster, "no_judge", total_train_steps=4,
                          reward={"function": "worker_only_reward:score"},
                          cluster={"address": ray_cluster["address"], "flow_retries": 0, "ray_get_timeout_s": 120})
    started = time.monotonic()
    with pytest.raises(Exception, match="judge_sdk"):
        rl_train(config)
    assert time.monotonic() - started < 120
    metrics = Path(config.run_uri, "logs", "metrics.jsonl")
    assert not metrics.exists() or logged_metrics(config) == {}
    held = [info["name"] for info in ray.util.placement_group_table().values()
            if info["name"].startswith("trellis-no_judge-") and info["state"] != "REMOVED"]
    assert held == []  # the failed start gave its devices back: the next run on the cluster can start
