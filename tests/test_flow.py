"""The colocated step as Prefect flow runs on a real local Ray cluster, trajectories as Parquet."""

from __future__ import annotations

import json
import time
from pathlib import Path
from uuid import UUID

import duckdb
import pyarrow.dataset as ds
import pytest
import ray
from prefect.client.orchestration import get_client

from trellis.flows.rl_train import rl_train
from helpers import tiny_config



def flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, **changes):
    """The example config's saving rules (checkpoints every 10 steps, auto-resume, HF at 50) over
    three steps that sync and evaluate every second step."""
    base = dict(
        total_train_steps=3,
        sync_weights_interval=2,
        checkpoint_interval=10,
        checkpoint_maxkeep=2,
        hf_interval=50,
        hf_max_keep=1,
        auto_resume=True,
        exp_tracker="tensorboard",
        cluster={"address": ray_cluster["address"]},
    )
    return tiny_config(tiny_model, reverse_data, tmp_path, **{**base, **changes})


def read_lake(config, split="train"):
    return ds.dataset(f"{config.run_uri}/trajectories/split={split}", format="parquet", partitioning="hive").to_table()


async def task_runs_named(prefix: str) -> list:
    async with get_client() as client:
        return [run for run in await client.read_task_runs() if run.name.startswith(prefix)]


def test_three_steps_of_the_real_flow(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    config = flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, experiment_name="three_steps",
                         trace={"enabled": True, "samples": False})
    started_us = time.time() * 1e6
    rl_train(config)

    table = read_lake(config)
    assert table.num_rows == 3 * config.train_batch_size * config.prompt_repeat_k
    rows = table.to_pylist()
    for column in ("run", "train_step", "policy_version", "rollout_id", "group_id", "session_id", "task_name",
                   "data_source", "status", "finish_reason", "error_msg", "prompt", "label", "response",
                   "prompt_ids", "response_ids", "rollout_logprobs", "reward", "reward_payload", "prompt_len", "response_len"):
        assert column in table.column_names
    assert all(r["response_ids"] and len(r["rollout_logprobs"]) == len(r["response_ids"]) for r in rows)
    assert len({r["rollout_id"] for r in rows}) == len(rows)
    # Weights sync every 2 steps: steps 1 and 2 are sampled by the initial policy, step 3 by step 2's.
    versions = {r["step"]: r["policy_version"] for r in rows}
    assert versions == {1: 0, 2: 0, 3: 2}

    # A user who knows nothing of trellis reads the same files with DuckDB.
    glob = f"{config.run_uri}/trajectories/split=train/*/*.parquet"
    per_step = duckdb.sql(f"SELECT CAST(step AS INT) AS s, count(*) FROM read_parquet('{glob}', hive_partitioning=true) GROUP BY s ORDER BY s").fetchall()
    assert per_step == [(1, 128), (2, 128), (3, 128)]
    eval_steps = [r["step"] for r in read_lake(config, "eval").to_pylist()]
    assert sorted(set(eval_steps)) == [0, 2] and len(eval_steps) == 64  # initial evaluation, then step 2

    names = {run.name for run in await_(task_runs_named(""))}
    for phase in ("produce_batch", "write_trajectories", "prepare_data", "fit", "log_step"):
        assert {f"{phase}[step={s}]" for s in (1, 2, 3)} <= names
    assert {"sync_weights[step=2]", "evaluate[step=2]"} <= names and "sync_weights[step=1]" not in names

    metrics = [line for line in (Path(config.run_uri) / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4  # initial evaluation + 3 steps
    # On CPU nothing moves between the sides, and placement is asked once per actor, not every step.
    calls = actor_calls_since(started_us, at_least={"load_weights": 1, "fit": 3, "generate": 3})
    assert calls.count("offload") == calls.count("onload") == calls.count("engine_may_stay_awake") == 0
    assert calls.count("load_weights") == 1
    assert calls.count("gpu_identity") <= 2  # the trainer and the rollout worker
    assert any((Path(config.run_uri) / "logs" / "tensorboard").iterdir())
    artifacts = await_(read_artifacts())
    assert {"three-steps-step-metrics", "three-steps-trajectories", "three-steps-eval-trajectories"} <= {a.key for a in artifacts}
    # Each step's metrics table belongs to that step's log_step task run.
    log_steps = {run.id: run for run in await_(task_runs_named("log_step"))}
    posted = [log_steps[a.task_run_id] for a in artifacts if a.key == "three-steps-step-metrics"]
    assert sorted(run.name for run in posted) == [f"log_step[step={s}]" for s in (1, 2, 3)]
    assert all(a.flow_run_id == log_steps[a.task_run_id].flow_run_id for a in artifacts if a.key == "three-steps-step-metrics")
    # The run log's step lines reach the UI too: each log_step task run logs its step's summary.
    lines = [log.message for log in await_(read_logs(list(log_steps)))]
    assert all(any(line.startswith(f"step {s}/3 ") and " reward " in line for line in lines) for s in (1, 2, 3)), lines

    # Traced (trace: enabled, spans in logs/traces.jsonl): a phase's span names its Prefect task run, a
    # step's span its flow run, and that flow run logs the trace's id.
    spans = [json.loads(line) for line in (Path(config.run_uri) / "logs" / "traces.jsonl").read_text().splitlines()]
    fits = {run.id: run for run in await_(task_runs_named("fit["))}
    fit_spans = [span for span in spans if span["name"] == "fit"]
    assert sorted(fits[UUID(span["attributes"]["prefect.task_run_id"])].name for span in fit_spans) == [f"fit[step={s}]" for s in (1, 2, 3)]
    step_spans = {span["attributes"]["trellis.step"]: span for span in spans if span["name"].startswith("step ")}
    assert {str(fits[UUID(span["attributes"]["prefect.task_run_id"])].flow_run_id) for span in fit_spans} == {
        step_spans[s]["attributes"]["prefect.flow_run_id"] for s in (1, 2, 3)}
    flow_logs = [log.message for log in await_(read_flow_logs([UUID(step_spans[1]["attributes"]["prefect.flow_run_id"])]))]
    assert f"OpenTelemetry trace {step_spans[1]['context']['trace_id'][2:]} (step 1)" in flow_logs


def test_run_log_lines_reach_the_ui_while_prefect_logs_only_warnings(prefect_api, capfd):
    """`trellis train` sets PREFECT_LOGGING_LEVEL=WARNING, which keeps Prefect's own line per task run off its
    console. Tried: Prefect's logger at WARNING and a task writing a step line and a warning to the run log's
    Prefect side. Both are in the task run's logs on the server; the step line was not printed to the console."""
    import logging

    from prefect import flow, task
    from prefect.logging.handlers import APILogHandler
    from prefect.runtime import task_run

    from trellis.tasks.run_tasks import _to_prefect_logger

    @task
    def writes() -> str:
        _to_prefect_logger("STEP", "step 1/3 reward 0.5")
        _to_prefect_logger("WARNING", "a worker was replaced")
        return task_run.get_id()

    @flow
    def run() -> str:
        return writes()

    prefect_logger = logging.getLogger("prefect")
    level = prefect_logger.level
    prefect_logger.setLevel(logging.WARNING)
    try:
        writer = run()
    finally:
        prefect_logger.setLevel(level)
    APILogHandler().flush()
    messages = [log.message for log in await_(read_logs([UUID(writer)]))]
    assert "step 1/3 reward 0.5" in messages and "a worker was replaced" in messages
    assert "step 1/3 reward 0.5" not in capfd.readouterr().err


async def read_logs(task_run_ids: list) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    async with get_client() as client:
        return await client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=task_run_ids)))


async def read_flow_logs(flow_run_ids: list) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        return await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=flow_run_ids)))


def actor_calls_since(started_us: float, at_least: dict[str, int], timeout_s: float = 120.0) -> list[str]:
    """The actor methods the cluster ran since ``started_us`` (one name per call), from Ray's timeline.
    Each Ray worker sends its events on its own, every second or so: read again until the timeline
    holds ``at_least`` calls of each name given and has stopped growing, so that a count is neither
    read short nor missing a late extra call."""
    deadline = time.monotonic() + timeout_s
    previous: list[str] | None = None
    while True:
        calls = sorted(event["cat"].split(".")[-1] for event in ray.timeline()
                       if event.get("ph") == "X" and str(event.get("cat")).startswith("task::") and float(event["ts"]) >= started_us)
        arrived = all(calls.count(name) >= count for name, count in at_least.items())
        if (arrived and calls == previous) or time.monotonic() > deadline:
            return calls
        previous = calls
        time.sleep(2.0)


async def read_artifacts():
    async with get_client() as client:
        return await client.read_artifacts()


def await_(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def test_launching_each_rollout_early_changes_no_sample_and_no_metric(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """The same seeded run with each step's rollout launched at the end of the previous step (the
    default) and launched by the step itself: identical trajectories, evaluations and metrics."""
    from helpers import lake_rows, logged_metrics

    def run(name, overlap):
        config = flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, experiment_name=name, sync_weights_interval=1,
                             evaluate_step=2, deterministic=True,
                             cluster={"address": ray_cluster["address"], "overlap_next_rollout": overlap})
        rl_train(config)
        return config

    early, in_step = run("early", True), run("in_step", False)
    assert lake_rows(early) == lake_rows(in_step) and len(lake_rows(early)) == 3 * 128
    assert lake_rows(early, "eval") == lake_rows(in_step, "eval")
    assert logged_metrics(early) == logged_metrics(in_step)
    launched = sorted(run.name for run in await_(step_task_runs("rl_run[early]")) if run.name.startswith("start_rollout"))
    assert launched == ["start_rollout[step=2]", "start_rollout[step=3]"]  # never past the run's end
    assert not [run for run in await_(step_task_runs("rl_run[in_step]")) if run.name.startswith("start_rollout")]


async def step_task_runs(run_name: str) -> list:
    """The task runs inside the step flow runs of the rl_run flow runs named ``run_name``."""
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter

    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [run_name]}))
        steps = await client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [r.id for r in runs]}))
        return await client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id={"any_": [s.id for s in steps]}))


def test_a_second_flow_run_reattaches_to_the_live_workers(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """A first flow run of 2 steps keeps its workers; a second one asking for 4 steps re-attaches to the
    same processes (their pids compared across the two runs) and trains steps 3 and 4 only."""
    from trellis.engine.cluster.workers import RunWorkers

    keep = {"address": ray_cluster["address"], "release_workers_at_end": False}
    first = flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, experiment_name="reattach", total_train_steps=2,
                        enable_evaluate=False, enable_initial_evaluate=False, cluster=keep)
    rl_train(first)
    workers = RunWorkers(first)
    before = workers.pids()

    second = first.model_copy(update={"total_train_steps": 4})
    rl_train(second)
    after = workers.pids()
    workers.release()
    assert after == before and len(set(before.values())) == 3
    rows = read_lake(second).to_pylist()
    assert sorted({r["step"] for r in rows}) == [1, 2, 3, 4]
    assert len(rows) == 4 * 128 and len({r["rollout_id"] for r in rows}) == len(rows)
    fit_runs = sorted(run.name for run in await_(step_task_runs("rl_run[reattach]")) if run.name.startswith("fit["))
    assert fit_runs == ["fit[step=1]", "fit[step=2]", "fit[step=3]", "fit[step=4]"]  # the two runs, once each
    trainer_steps = sorted(r["train_step"] for r in rows if r["policy_version"] == 2)
    assert trainer_steps and min(trainer_steps) == 3  # step 3 sampled by the weights the first run left
    with pytest.raises(ValueError):
        workers.actor("trainer")


@pytest.mark.parametrize("overlap, retried_task", [(False, "produce_batch"), (True, "start_rollout")])
def test_a_lost_rollout_worker_is_restarted_by_the_task_retry(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api,
                                                             overlap, retried_task):
    """While step 1 is scored, the rollout worker is SIGKILLed. Launching step 2's rollout fails on it
    (in produce_batch, or in step 1's start_rollout when rollouts are launched early), Prefect retries
    the task, the retry restarts the worker with the trainer's current weights, and the run ends with
    every sample of every step in the lake exactly once."""
    from trellis.engine.cluster.workers import RunWorkers

    config = flow_config(tiny_model, reverse_data, tmp_path, ray_cluster, experiment_name=f"lost_rollout_{retried_task}",
                         enable_evaluate=False, enable_initial_evaluate=False, total_train_steps=4,
                         reward={"function": "fault_rewards:kill_rollout_once"},
                         cluster={"address": ray_cluster["address"], "overlap_next_rollout": overlap})
    workers = RunWorkers(config)
    workers.attach()
    rollout_pid = workers.pids()["rollout"]
    kill_file = ray_cluster["kill_file"]
    kill_file.write_text(str(rollout_pid))  # armed: the first scoring call kills the rollout worker
    rl_train(config)

    retried = [run for run in await_(step_task_runs(f"rl_run[{config.experiment_name}]")) if run.run_count > 1]
    assert [(run.name, run.run_count, run.state_name) for run in retried] == [(f"{retried_task}[step=2]", 2, "Completed")]
    log = (Path(config.log_uri) / "run.log").read_text()
    assert f"WARNING {retried_task}[step=2]: retry 1 after a failure; replacing lost rollout workers" in log
    assert not kill_file.exists()
    rows = read_lake(config).to_pylist()
    assert len(rows) == 4 * 128 and len({r["rollout_id"] for r in rows}) == len(rows)
    versions = {r["step"]: r["policy_version"] for r in rows}
    # No sync at step 1 (interval 2), but the restarted worker took the trainer's step-1 weights.
    assert versions == {1: 0, 2: 1, 3: 2, 4: 2}
    with pytest.raises(ValueError):  # the run released its workers, the restarted one included
        workers.actor("rollout")


def test_debug_rollout_then_debug_train_as_flow_runs(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """Rollout only into a lake, then training only from it: each starts only the workers it needs,
    and the replayed first step has the loss of an ordinary run's first step."""
    from trellis.engine.run.local import LocalRun
    from helpers import logged_metrics

    def config(name, **changes):
        keep = {"address": ray_cluster["address"], "release_workers_at_end": False}
        return tiny_config(tiny_model, reverse_data, tmp_path, experiment_name=name, checkpoint_interval=-1,
                           enable_initial_evaluate=False, cluster=keep, **changes)

    original = config("original", total_train_steps=1)
    with LocalRun(original) as local:
        local.run()
    lake = str(tmp_path / "lake")
    rollout_only = config("rollout_only", total_train_steps=2, debug_rollout=True, debug_rollout_dir=lake)
    rl_train(rollout_only)
    train_only = config("train_only", total_train_steps=None, debug_train=True, debug_rollout_dir=lake, enable_evaluate=False)
    rl_train(train_only)

    def alive(cfg, role):
        try:
            ray.get_actor(f"{cfg.experiment_name}-{role}", namespace=cfg.ray_namespace)
            return True
        except ValueError:
            return False

    assert [alive(rollout_only, r) for r in ("controller", "trainer", "rollout")] == [True, False, True]
    assert [alive(train_only, r) for r in ("controller", "trainer", "rollout")] == [True, True, False]
    from trellis.engine.cluster.workers import RunWorkers

    RunWorkers(rollout_only).release()
    RunWorkers(train_only).release()
    assert sorted(r["step"] for r in ds.dataset(f"{lake}/trajectories/split=train", partitioning="hive").to_table().to_pylist()[::128]) == [1, 2]
    want, got = logged_metrics(original)[1], logged_metrics(train_only)
    assert sorted(got) == [1, 2]
    # The loss terms match exactly. (Rollout logprobs computed in a Ray worker and in this process
    # may differ in the last bits, so the train/rollout mismatch metrics are not compared.)
    for key in ("train/pg_loss", "train/grad_norm", "train/entropy", "train/clipfrac"):
        assert got[1][key] == want[key], key
