"""Things break on purpose while the real flow runs on a real Ray cluster: the flow process is
SIGKILLed mid-step, the training worker is SIGKILLed mid-step, the rollout worker is SIGKILLed or frozen
between steps. Each run still ends with the same trajectories and metrics as a run nothing happened to."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter

from trellis.engine.cluster.workers import RunWorkers
from trellis.engine.storage.checkpoints import SaveStore
from trellis.engine.storage.store import Store
from trellis.flows.rl_train import rl_train
from helpers import flow_runs, lake_rows, ledger_check, logged_metrics, tiny_config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, name, **changes):
    changes = {"total_train_steps": STEPS, "cluster": ray_cluster["cluster"], **changes}  # its home: the subprocess's token
    return tiny_config(tiny_model, reverse_data, tmp_path, experiment_name=name, **changes)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, reverse_data, tmp_path_factory, ray_cluster, prefect_api):
    """The reference: the same run, with nothing killed."""
    config = flow_config(tiny_model, reverse_data, tmp_path_factory.mktemp("whole"), ray_cluster, "whole")
    rl_train(config)
    return config


def test_a_flow_process_killed_mid_step_resumes_to_the_same_metrics_and_trajectories(
    tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api, uninterrupted
):
    config = flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, "killed")
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    trellis = str(Path(sys.executable).with_name("trellis"))
    flow_process = subprocess.Popen(
        [trellis, "train", str(config_file)], cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    step_three = tmp_path / "killed" / "trajectories" / "split=train" / "step=000003" / "part-0.parquet"
    deadline = time.time() + 300
    while not step_three.exists():  # step 3 is under way: its rollouts are written beside its fit
        assert flow_process.poll() is None, "the flow process ended before it could be killed"
        assert time.time() < deadline, "step 3 never started"
        time.sleep(0.05)
    os.killpg(flow_process.pid, signal.SIGKILL)  # the process and its temporary Prefect server
    flow_process.wait(timeout=30)

    interrupted = logged_metrics(config)
    assert max(interrupted) < STEPS, "the run was not interrupted"
    latest = SaveStore(Store(config.checkpoint_uri)).latest()
    assert latest is not None and latest[0] < STEPS
    trainer = ray.get_actor("killed-trainer", namespace=config.ray_namespace)  # detached workers survive
    trainer_pid = ray.get(trainer.pid.remote())

    keep_workers = config.cluster.model_copy(update={"release_workers_at_end": False})
    rl_train(config.model_copy(update={"cluster": keep_workers}), resume=True)  # as `trellis train --resume` does

    assert ray.get(trainer.pid.remote()) == trainer_pid  # re-attached to the surviving trainer, restored in place
    RunWorkers(config).release()
    assert logged_metrics(config) == logged_metrics(uninterrupted)
    assert lake_rows(config) == lake_rows(uninterrupted)
    assert lake_rows(config, "eval") == lake_rows(uninterrupted, "eval")
    assert flow_process.returncode == -signal.SIGKILL  # the kill, not an exit of its own, ended it
    ledger_check(config)
    (run,) = flow_runs("rl_run[killed]")  # the killed run lived on the temporary server that died with it
    restored = [r for r in _task_runs("restore_checkpoint") if r.flow_run_id == run.id]
    assert [r.state_name for r in restored] == ["Completed"]


def test_a_training_worker_killed_mid_step_is_recovered_by_a_flow_retry(
    tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api, uninterrupted
):
    """While step 3 is scored, the trainer is SIGKILLed. fit[step=3] fails, the flow run fails and
    Prefect retries it; the retry creates a new trainer, restores the step-2 checkpoint into it and
    into the live controller and rollout worker, and redoes steps 3-6."""
    config = flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, "trainer_killed",
                         reward={"function": "fault_rewards:kill_once"})
    workers = RunWorkers(config)
    workers.attach()
    trainer_pid = workers.pids()["trainer"]
    kill_file = ray_cluster["kill_file"]
    kill_file.write_text(f"{trainer_pid} {32 + 2 * 16 * 8}")  # after the initial evaluation and steps 1-2
    rl_train(config)

    assert not kill_file.exists()
    (run,) = flow_runs("rl_run[trainer_killed]")
    assert run.run_count == 2 and run.state_name == "Completed"
    log = (Path(config.log_uri) / "run.log").read_text()  # what the operator reads: the failure, its actor, the retry
    failure = next(line for line in log.splitlines() if " ERROR step 3 failed: " in line)
    assert "trainer_killed-trainer" in failure, failure  # the actor, by name
    assert " WARNING attempt 2 of the run (a Prefect retry): from checkpoint " in log and "step-000002 (step 2)" in log
    rows = lake_rows(config)
    assert len(rows) == STEPS * 128 and len({r["rollout_id"] for r in rows}) == len(rows)
    assert rows == lake_rows(uninterrupted)
    assert logged_metrics(config) == logged_metrics(uninterrupted)
    ledger_check(config)


@pytest.mark.parametrize("damage", ["kill_once", "freeze_once"])
def test_a_dead_or_hung_rollout_engine_is_replaced_before_a_step_needs_it(
    tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api, uninterrupted, damage
):
    """While step 3 is scored, the rollout worker's process is SIGKILLed (dead) or SIGSTOPped (hung:
    alive, answering nothing). Step 3's health check, before its weight sync, finds it (the frozen one
    by a heartbeat that times out), replaces it, and the sync gives the new engine the trainer's
    weights: no task fails or is retried (without the check, step 3's sync_weights fails and its
    retry replaces the engine, or waits on the frozen one until ray_get_timeout_s), the old process
    is gone, and the run ends with the trajectories and metrics of a run nothing happened to."""
    rollout = {**yaml.safe_load((ROOT / "configs" / "tiny_reverse.yaml").read_text())["rollout"],
               "health_check": {"interval": 1, "probe_timeout_s": 5}}
    name = f"engine_{damage}"
    config = flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, name, reward={"function": f"fault_rewards:{damage}"},
                         rollout=rollout)
    workers = RunWorkers(config)
    workers.attach()
    engine_pid = workers.pids()["rollout"]
    kill_file = ray_cluster["kill_file"]
    kill_file.write_text(f"{engine_pid} {32 + 2 * 16 * 8 + 32 + 3}")  # evaluations at 0 and 2, steps 1-2, then into step 3
    rl_train(config)

    assert not kill_file.exists()
    metrics = logged_metrics(config)
    assert [metrics[step]["health/replaced_engines"] for step in range(1, STEPS + 1)] == [0, 0, 1, 0, 0, 0]
    assert metrics[3]["health/hung_engines"] == float(damage == "freeze_once")
    assert not _process_lives(engine_pid)
    (run,) = flow_runs(f"rl_run[{name}]")
    assert run.run_count == 1 and run.state_name == "Completed"
    tasks = asyncio.run(_step_task_runs(run.id))
    assert "check_rollout[step=3]" in {task.name for task in tasks}
    assert [task.name for task in tasks if task.run_count > 1 or task.state_name != "Completed"] == []
    log = (Path(config.log_uri) / "run.log").read_text()
    assert "the health check replaced 1 rollout engine(s)" in log
    found = "hung: no answer to a heartbeat in 5s" if damage == "freeze_once" else "dead: "
    assert f"The health check found rollout worker 0 ({name}-rollout) {found}" in log
    assert lake_rows(config) == lake_rows(uninterrupted)
    assert _without_health(logged_metrics(config)) == _without_health(logged_metrics(uninterrupted))


def _process_lives(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie left for its parent to reap counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _without_health(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {step: {k: v for k, v in m.items() if not k.startswith("health/")} for step, m in metrics.items()}


async def _step_task_runs(run_id) -> list:
    """The task runs of the step flow runs under the flow run ``run_id``."""
    from prefect.client.schemas.filters import FlowRunFilter

    async with get_client() as client:
        steps = await client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [run_id]}))
        return await client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id={"any_": [step.id for step in steps]}))


def _task_runs(name: str) -> list:
    async def read():
        async with get_client() as client:
            return await client.read_task_runs(task_run_filter=TaskRunFilter(name={"like_": name}))

    return asyncio.run(read())


def test_a_refused_fresh_start_stays_refused_on_the_flow_retry(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """A new run over a finished one is refused; Prefect's retry of that failure must not turn it into
    a resume (only a flow run that got past its start decision resumes on retry)."""
    from trellis.engine.run.resume import RunExistsError

    config = flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, "refused", total_train_steps=2,
                         enable_evaluate=False, enable_initial_evaluate=False)
    rl_train(config)
    before = (tmp_path / "refused" / "logs" / "metrics.jsonl").read_text()
    with pytest.raises(RunExistsError):
        rl_train(config.model_copy(update={"total_train_steps": 3}))
    runs = sorted(flow_runs("rl_run[refused]"), key=lambda r: r.expected_start_time)
    assert [(r.run_count, r.state_name) for r in runs] == [(1, "Completed"), (2, "Failed")]
    assert (tmp_path / "refused" / "logs" / "metrics.jsonl").read_text() == before  # step 3 never ran
    RunWorkers(config).release()
