"""The operator's side on a real Prefect server process: `trellis server up` (server, work pool, worker,
deployments), the training deployment run for 3 steps, then evaluate_checkpoint, rescore, export and
replay from their deployments; Prefect's records checked through its client; lineage from a trajectory row to
its flow run and checkpoint; a fork of the run that starts where it should; operator mistakes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TRELLIS = str(Path(sys.executable).with_name("trellis"))

pytestmark = pytest.mark.slow


def trellis(*args: str, env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([TRELLIS, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import _free_port

    home = tmp_path_factory.mktemp("trellis-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    up = trellis("server", "up", "--home", str(home), "--port", str(_free_port()), env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads((home / "prefect" / "server.json").read_text())
    env["PREFECT_API_URL"] = f"{state['url']}/api"
    yield {"home": home, "env": env, "state": state}
    down = trellis("server", "down", "--home", str(home), env=env)
    assert down.returncode == 0 and "stopped" in down.stdout
    import psutil

    assert not any(psutil.pid_exists(state[key]) and psutil.Process(state[key]).status() != "zombie" for key in ("server_pid", "worker_pid"))


@pytest.fixture(scope="module")
def client(server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server["env"]["PREFECT_API_URL"]}):
        yield


def run_config(tiny_model, reverse_data, work_dir: Path, ray_cluster, **changes) -> dict:
    config = yaml.safe_load((ROOT / "configs" / "tiny_reverse.yaml").read_text())
    config.update(
        load_from=str(tiny_model),
        train_dataset={"path": str(reverse_data["train"]), "max_prompt_length": 64},
        eval_dataset={"path": str(reverse_data["eval"]), "max_prompt_length": 64, "limit": 32},
        work_dir=str(work_dir), experiment_name="served", total_train_steps=3, evaluate_step=3,
        checkpoint_interval=3, hf_interval=-1, enable_initial_evaluate=False, exp_tracker="jsonl",
        cluster=ray_cluster["cluster"],  # the flow runs in the worker's process: the head's token is under its home
    )
    config.update(changes)
    return config


def run_deployment(name: str, parameters: dict):
    from prefect.deployments import run_deployment as run

    flow_run = run(name, parameters=parameters, timeout=900)
    assert flow_run.state.is_completed(), f"{name}: {flow_run.state.type} {flow_run.state.message}"
    return flow_run


def read(coroutine_factory):
    import asyncio

    from prefect.client.orchestration import get_client

    async def go():
        async with get_client() as client:
            return await coroutine_factory(client)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def served_run(server, client, tiny_model, reverse_data, ray_cluster, tmp_path_factory):
    work_dir = tmp_path_factory.mktemp("served-work")
    config = run_config(tiny_model, reverse_data, work_dir, ray_cluster)
    runs = {
        "train": run_deployment("rl_train/tiny-reverse", {"config": config}),
        "evaluate": run_deployment("evaluate_checkpoint/tiny-reverse", {"config": config, "samples_per_prompt": 4, "temperature": 1.0}),
        "rescore": run_deployment("rescore/tiny-reverse", {"config": config}),
        "export": run_deployment("export/tiny-reverse", {"config": config, "out": str(work_dir / "exported")}),
        "replay": run_deployment("replay/tiny-reverse", {"config": config, "step": 3, "changes": ["loss.clip_eps_high=0.28"], "name": "clip"}),
    }
    return {"config": config, "work_dir": work_dir, "run": work_dir / "served", "flow_runs": runs}


def test_the_deployments_ran_as_flow_runs_with_task_runs_and_artifacts(served_run):
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter

    names = {run.name for run in read(lambda c: c.read_flow_runs())}
    assert {"rl_train[served]", "rl_run[served]", "rl_step[step=1]", "rl_step[step=3]", "evaluate_checkpoint[served]",
            "rescore[served]", "export[served]", "replay[served@3]"} <= names
    step_runs = read(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": ["rl_step[step=3]"]})))
    tasks = read(lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [step_runs[0].id]})))
    assert {"produce_batch[step=3]", "fit[step=3]", "save_checkpoint[step=3]", "evaluate[step=3]", "commit_checkpoint[step=3]"} <= {t.name for t in tasks}
    assert all(t.state.is_completed() for t in tasks)
    keys = {a.key for a in read(lambda c: c.read_artifacts(artifact_filter=ArtifactFilter()))}
    assert {"served-step-metrics", "served-checkpoint", "served-trajectories", "served-checkpoint-eval", "served-rescore", "served-export",
            "served-report", "served-replay-3"} <= keys
    replayed = read(lambda c: c.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": ["served-replay-3"]})))
    assert "# Replay of step 3" in replayed[0].data and "`loss.clip_eps_high=0.28`" in replayed[0].data
    evaluation_tables = read(lambda c: c.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": ["served-checkpoint-eval"]})))
    table = json.loads(evaluation_tables[0].data)
    assert table[0]["data_source"] == "reverse" and 0.0 <= table[0]["accuracy"] <= table[0]["pass@4"] <= 1.0
    assert table[0]["samples"] == 32 * 4  # the eval set's 32 prompts, 4 samples each
    for kind in ("evaluate", "rescore", "export", "replay"):
        flow_run_id = served_run["flow_runs"][kind].id
        tasks = read(lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]})))
        assert tasks and all(t.state.is_completed() for t in tasks), kind


def test_results_of_the_offline_deployments_landed(served_run):
    run = served_run["run"]
    splits = {p.name for p in (run / "trajectories").iterdir()}
    assert {"split=train", "split=eval", "split=checkpoint_eval", "split=rescore-partial_score"} <= splits
    rescored = ds.dataset(run / "trajectories" / "split=rescore-partial_score", partitioning="hive").to_table().to_pylist()
    original = {r["rollout_id"]: r for r in ds.dataset(run / "trajectories" / "split=train", partitioning="hive").to_table().to_pylist()}
    assert len(rescored) == len(original)
    for row in rescored:  # partial credit is never below the exact-match reward of the same response
        assert row["response"] == original[row["rollout_id"]]["response"]
        assert row["reward"] >= original[row["rollout_id"]]["reward"]
        assert json.loads(row["reward_payload"])["previous_reward"] == original[row["rollout_id"]]["reward"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(served_run["work_dir"] / "exported") is not None
    assert json.loads((served_run["work_dir"] / "exported" / "lineage.json").read_text())["step"] == 3
    # No checkpoint before step 3: the replay began where the run did and applied stored steps 1 and 2 first.
    comparison = json.loads((run / "replays" / "step-000003-clip" / "comparison.json").read_text())
    assert comparison["bridged_steps"] == [1, 2] and comparison["trained_tokens"] > 0 and comparison["changes"] == ["loss.clip_eps_high=0.28"]


def test_lineage_resolves_a_row_to_its_flow_run_and_checkpoint(served_run, server):
    from prefect.client.schemas.filters import FlowRunFilter

    run = served_run["run"]
    rows = ds.dataset(run / "trajectories" / "split=train", partitioning="hive").to_table().to_pylist()
    row = next(r for r in rows if r["step"] == 2)
    step_flow = read(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": ["rl_step[step=2]"]})))
    assert row["flow_run_id"] == str(step_flow[0].id)
    assert row["policy_version"] == 1 and row["checkpoint"] is None  # version 1 was never saved
    assert {r["checkpoint"] for r in rows if r["step"] == 1} == {served_run["config"]["load_from"]}

    shown = trellis("lineage", "served@3", "--work-dir", str(served_run["work_dir"]), "--sample", row["rollout_id"], env=server["env"])
    assert shown.returncode == 0, shown.stderr
    ui = server["state"]["url"]
    assert f"{ui}/runs/flow-run/{row['flow_run_id']}" in shown.stdout
    assert "evaluation" in shown.stdout and str(run / "checkpoints" / "step-000003") in shown.stdout
    assert str(served_run["work_dir"] / "exported") in shown.stdout
    assert str(served_run["flow_runs"]["evaluate"].id) in shown.stdout
    lineage = json.loads((run / "checkpoints" / "step-000003" / "lineage.json").read_text())
    assert [t["step"] for t in lineage["trained_on"]] == [1, 2, 3] and len(lineage["flow_runs"]) == 3


def test_a_fork_starts_at_the_checkpoint_it_forks_and_says_so(served_run, server, tmp_path):
    config = dict(served_run["config"], experiment_name="forked", total_train_steps=4, checkpoint_interval=4)
    path = tmp_path / "forked.yaml"
    path.write_text(yaml.safe_dump(config))
    forked = trellis("train", str(path), "--fork", "served@3", env=server["env"])
    assert forked.returncode == 0, forked.stdout[-2000:] + forked.stderr[-3000:]
    assert "run forked: from checkpoint served/checkpoints/step-000003 (step 3)" in forked.stdout.replace(str(served_run["work_dir"]) + "/", "")
    assert "train prompts: 4096 rows read, all usable" in forked.stdout  # the run log, tailed beside the bar
    fork_run = served_run["work_dir"] / "forked"
    plan = json.loads((fork_run / "logs" / "run_plan.json").read_text())
    assert plan["start"]["step"] == 3 and plan["start"]["checkpoint"].endswith("served/checkpoints/step-000003")
    steps = [json.loads(line)["step"] for line in (fork_run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4]
    shown = trellis("lineage", "forked@4", "--work-dir", str(served_run["work_dir"]), env=server["env"])
    assert shown.returncode == 0 and "forked from" in shown.stdout, shown.stdout + shown.stderr


def test_operator_mistakes_get_clear_messages(served_run, server, tmp_path):
    from prefect.deployments import run_deployment as run

    env, work_dir = server["env"], str(served_run["work_dir"])
    # A deployment parameter of the wrong type is refused before anything runs.
    bad = dict(served_run["config"], train_batch_size="many")
    with pytest.raises(Exception, match="train_batch_size"):
        run("rl_train/tiny-reverse", parameters={"config": bad}, timeout=0)
    # A fork from an incomplete checkpoint, from a step that was never saved, from a run that does not exist.
    incomplete = served_run["run"].parent / "half"
    shutil.copytree(served_run["run"] / "checkpoints", incomplete / "checkpoints")
    (incomplete / "checkpoints" / "step-000003" / "COMPLETE").unlink()
    path = tmp_path / "fork.yaml"
    path.write_text(yaml.safe_dump(dict(served_run["config"], experiment_name="fork2")))
    for source, message in [("half@3", "incomplete"), ("served@2", "does not exist"), ("nobody@3", "No run named 'nobody'"),
                            ("served@x", "step number")]:
        refused = trellis("train", str(path), "--fork", source, env=env)
        assert refused.returncode == 2 and message in refused.stderr, (source, refused.stderr)
    # lineage of a step with no checkpoint, of a run that does not exist.
    missing = trellis("lineage", "served@2", "--work-dir", work_dir, env=env)
    assert missing.returncode == 2 and "Complete checkpoints of this run: 3" in missing.stderr
    assert trellis("lineage", "ghost@1", "--work-dir", work_dir, env=env).returncode == 2
    status = trellis("server", "status", "--home", str(server["home"]), env=env)
    assert status.returncode == 0 and "worker for pool trellis-local: running" in status.stdout
