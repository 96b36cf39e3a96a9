"""The two runners follow one plan. The same seeded, deterministic config, run in this process
(``LocalRun``) and as Prefect flow runs driving Ray actors (``rl_train``), writes identical trajectory
rows (token ids, logprobs, rewards, policy versions), identical non-time metrics per step, and runs
the same phases in the same order: the flow's task runs, step by step, are the in-process phases.
The disaggregated trainer is held to what it makes deterministic (see its test)."""

from __future__ import annotations

import asyncio
from collections import Counter

import duckdb
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter

from trellis.engine.run.local import LocalRun
from trellis.flows.rl_train import rl_train
from helpers import lake_rows, logged_metrics, tiny_config


async def _phases_by_step(run_name: str) -> dict[int, list[str]]:
    """The task runs of each ``rl_step`` flow run under the ``rl_run`` named ``run_name``, by start time; for
    a step run twice (a disaggregated step whose batch expired goes again), its last run."""
    async with get_client() as client:
        (run,) = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [run_name]}))
        steps = await client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [run.id]}))
        phases = {}
        for step in sorted(steps, key=lambda step: step.start_time):
            tasks = await client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id={"any_": [step.id]}))
            ordered = sorted(tasks, key=lambda task: task.start_time)
            phases[int(step.name.split("=")[1].rstrip("]"))] = [task.name.split("[")[0] for task in ordered]
        return phases


def _in_order(phases: list[str]) -> list[str]:
    """write_trajectories runs beside prepare_data and fit, so its start may fall on either side."""
    return [phase for phase in phases if phase != "write_trajectories"]


def test_the_in_process_run_and_the_flow_run_are_the_same_run(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    changes = dict(
        total_train_steps=3, sync_weights_interval=1, evaluate_step=2, checkpoint_interval=2, hf_interval=3,
        check_weights_interval=1, deterministic=True, cluster={"address": ray_cluster["address"], "overlap_next_rollout": True},
    )
    local = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="parity_local", **changes)
    with LocalRun(local) as run:
        reports = run.run()
    flow = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="parity_flow", **changes)
    rl_train(flow)

    assert len(lake_rows(local)) == 3 * 128
    assert lake_rows(local) == lake_rows(flow)
    assert lake_rows(local, "eval") == lake_rows(flow, "eval")
    assert sorted(logged_metrics(local)) == [0, 1, 2, 3]
    assert logged_metrics(local) == logged_metrics(flow)

    flow_phases = asyncio.run(_phases_by_step("rl_run[parity_flow]"))
    local_phases = {report.step: list(report.phases) for report in reports if report.step > 0}
    assert local_phases[3] == [
        "produce_batch", "write_trajectories", "prepare_data", "fit", "save_checkpoint", "export_hf", "sync_weights",
        "check_weights", "log_step", "commit_checkpoint",
    ]
    assert "start_rollout" in local_phases[1] and "evaluate" in local_phases[2]
    for step, phases in local_phases.items():
        assert sorted(flow_phases[step]) == sorted(phases), step
        assert _in_order(flow_phases[step]) == _in_order(phases), step
    assert all(logged_metrics(local)[step]["weights/largest_difference"] == 0.0 for step in (1, 2, 3))


def _ledger_totals(config) -> dict[str, int]:
    groups = f"read_parquet('{config.run_uri}/ledger/groups/*/*.parquet')"
    return dict(duckdb.sql(f"SELECT status, count(*) FROM {groups} GROUP BY status").fetchall())


def test_the_disaggregated_trainer_runs_the_same_run_in_process_and_through_the_flow(
    tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api
):
    """The producer runs beside the trainer on a thread of its own, so which samples make which batch (and
    whether a step finds its batch expired and goes again) depends on timing: rows and metric values
    differ between any two runs, even of one runner. What the plan decides does not: the phases of each
    step in their order (of its last attempt), the rows per step, the names of the metrics logged at
    each step (the initial evaluation's included), and the ledger's totals by status."""
    changes = dict(
        trainer="disaggregated", replay_buffer={"max_staleness": 1}, total_train_steps=3, sync_weights_interval=1,
        enable_evaluate=True, enable_initial_evaluate=True, evaluate_step=2, checkpoint_interval=2, check_weights_interval=1,
        cluster={"address": ray_cluster["address"]},
    )
    local = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="parity_async_local", **changes)
    with LocalRun(local) as run:
        reports = run.run()
    flow = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="parity_async_flow", **changes)
    rl_train(flow)

    def rows_per_step(config, split="train"):
        return Counter(row["train_step"] for row in lake_rows(config, split))

    assert rows_per_step(local) == rows_per_step(flow) == {1: 128, 2: 128, 3: 128}
    assert rows_per_step(local, "eval") == rows_per_step(flow, "eval")
    local_metrics, flow_metrics = logged_metrics(local), logged_metrics(flow)
    assert sorted(local_metrics) == sorted(flow_metrics) == [0, 1, 2, 3]
    assert {step: sorted(m) for step, m in local_metrics.items()} == {step: sorted(m) for step, m in flow_metrics.items()}
    assert _ledger_totals(local) == _ledger_totals(flow) == {"trained": 3 * 16}

    flow_phases = asyncio.run(_phases_by_step("rl_run[parity_async_flow]"))
    local_phases = {report.step: list(report.phases) for report in reports}
    assert local_phases[0] == ["evaluate", "log_evaluation"]
    assert local_phases[2] == [
        "get_batch", "write_trajectories", "prepare_data", "fit", "pause_produce", "save_checkpoint", "sync_weights",
        "check_weights", "evaluate", "continue_produce", "log_step", "commit_checkpoint",
    ]
    for step in (1, 2, 3):
        assert sorted(flow_phases[step]) == sorted(local_phases[step]), step
        assert _in_order(flow_phases[step]) == _in_order(local_phases[step]), step
