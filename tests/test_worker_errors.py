"""A worker's failure as a user of `trellis train` meets it: one line on the console that names the
worker and the cause, exit code 2 for a setting to change and 1 otherwise, the full traceback (the
worker's included) in the run log, and what happens next when a worker is lost. Each test runs the
real command from a project folder of its own, on a head of the module's own (`trellis cluster up`
with a cluster home in tmp), with the module's Prefect API, whose records are read back."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from helpers import flow_runs

ROOT = Path(__file__).resolve().parents[1]
TRELLIS = str(Path(sys.executable).with_name("trellis"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live_cluster(tmp_path_factory):
    from conftest import _free_port

    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_"))}
    up = subprocess.run([TRELLIS, "cluster", "up", "--home", str(home), "--port", str(_free_port()), "--num-cpus", "2"],
                        env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr
    yield {"home": home, "pid": json.loads((home / "ray-head.json").read_text())["pid"]}
    down = subprocess.run([TRELLIS, "cluster", "down", "--home", str(home)], env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stderr


def train(project: Path, name: str, tiny_model, reverse_data, live_cluster, *args: str, env: dict[str, str] | None = None,
          **changes) -> subprocess.CompletedProcess:
    """`trellis train my.yaml` in ``project``: 4 steps of 16 prompts, a checkpoint every 2, no evaluation."""
    from prefect.settings import PREFECT_API_URL

    config = yaml.safe_load((ROOT / "configs" / "tiny_reverse.yaml").read_text())
    config.update(
        load_from=str(tiny_model), train_dataset={"path": str(reverse_data["train"]), "max_prompt_length": 64},
        eval_dataset=None, enable_evaluate=False, enable_initial_evaluate=False, work_dir="runs", experiment_name=name,
        total_train_steps=4, checkpoint_interval=2, hf_interval=-1, auto_resume=False, exp_tracker="jsonl",
        cluster={"home": str(live_cluster["home"])},
    )
    config.update(changes)
    (project / "my.yaml").write_text(yaml.safe_dump(config))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_"))}
    prefect_home = project.parent / f"{project.name}-prefect"  # outside the project folder, whose code is shipped
    base.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_HOME=str(prefect_home), **(env or {}))
    return subprocess.run([TRELLIS, "train", "my.yaml", *args], cwd=project, env=base, capture_output=True, text=True, timeout=900)


def console(result: subprocess.CompletedProcess) -> list[str]:
    """The lines a user reads, stdout and stderr: every line the progress bar did not redraw over."""
    lines = []
    for line in (result.stdout + "\n" + result.stderr).split("\n"):
        for part in line.split("\r"):
            if part.strip() and not part.strip().startswith("train:"):
                lines.append(part.strip())
    return lines


def run_log(project: Path, name: str) -> str:
    return (project / "runs" / name / "logs" / "run.log").read_text()


def traceback_lines(log: str) -> list[str]:
    return [line.split(" TRACE ", 1)[1] for line in log.splitlines() if " TRACE " in line]


def task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    return asyncio.run(read())


def flow_run_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read():
        async with get_client() as client:
            return await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))

    return [log.message for log in asyncio.run(read())]


def test_a_setting_a_worker_refuses_ends_the_run_with_one_line_and_exit_code_2(
    tmp_path, tiny_model, reverse_data, live_cluster, prefect_api
):
    """Tried: `train_worker.attention_kernel: fa4` on this CPU machine, which the trainer refuses while
    it is built (in its Ray actor's constructor). Before, ~750 lines of Ray and Prefect tracebacks (the
    flow retried, the task retried). Now: one line naming trainer rank 0 and the setting, exit code 2,
    neither the task nor the flow retried, and the worker's traceback in the run log."""
    result = train(tmp_path, "fa4", tiny_model, reverse_data, live_cluster, train_worker={"attention_kernel": "fa4"})

    assert result.returncode == 2, result.stdout + result.stderr
    assert console(result) == [
        "error: the run's start failed: trainer rank 0 (fa4-trainer) failed while it was built: "
        "train_worker.attention_kernel: fa4 cannot run here: it runs on CUDA GPUs and the trainer runs on cpu. "
        "Use attention_kernel: torch. The run ends: change that setting (a setting error is not retried)"
    ], result.stdout + result.stderr
    log = run_log(tmp_path, "fa4")
    assert " ERROR the run's start failed: trainer rank 0 (fa4-trainer) failed while it was built: " in log
    trace = traceback_lines(log)
    assert trace[0] == "Traceback (most recent call last):"
    assert "trellis.engine.errors.SettingError: train_worker.attention_kernel: fa4 cannot run here: it runs on CUDA GPUs" in "\n".join(trace)
    assert any('in __init__' in line for line in trace) and any("TrainingWorker(config" in line for line in trace)  # the worker's frames

    (run,) = flow_runs("rl_run[fa4]")
    assert (run.run_count, run.state_name) == (1, "Failed")  # not retried: the retry would meet the same setting
    assert run.state.message == "Flow run encountered an exception: WorkerSettingError: " + console(result)[0].split(
        "error: the run's start failed: ")[1].split(" The run ends")[0]
    (attach,) = [r for r in task_runs(run.id) if r.name.startswith("attach_workers")]
    assert (attach.run_count, attach.state_name) == (1, "Failed")


def test_a_step_that_crashes_ends_the_run_with_one_line_and_exit_code_1(tmp_path, tiny_model, reverse_data, live_cluster, prefect_api):
    """Tried: a file where step 2's trajectories go, so the controller's write fails (a storage fault)
    in step 2, on each of the task's three tries; the run has no flow retry. The console says, on one
    line, which step failed, in which worker and call, and why; exit code 1; the run log holds the
    controller's traceback."""
    blocked = tmp_path / "runs" / "crash" / "trajectories" / "split=train" / "step=000002"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("in the way")
    result = train(tmp_path, "crash", tiny_model, reverse_data, live_cluster, cluster={"home": str(live_cluster["home"]), "flow_retries": 0})

    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line for line in console(result) if line.startswith("error")]
    assert failed == [
        "error: step 2 failed: the controller (crash-controller) failed in write_trajectories: FileExistsError: "
        f"[Errno 17] File exists: '{blocked}'; the run ends: cluster.flow_retries is 0"
    ], result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    trace = "\n".join(traceback_lines(run_log(tmp_path, "crash")))
    assert "in write_trajectories" in trace and "fs.makedirs(folder, exist_ok=True)" in trace  # the controller's frames
    assert trace.rstrip().endswith(f"trellis.engine.errors.WorkerError: {failed[0].split('step 2 failed: ')[1].split('; the run ends')[0]}")


LOST_TRAINER_CAUSES = {  # the run's words -> Ray's, in the run log's traceback
    "no live worker of that name": "Failed to look up actor with name",
    "its process died": "The actor died unexpectedly",
}


@pytest.mark.parametrize("retries", [1, 0])
def test_a_trainer_killed_mid_run_is_named_with_what_happens_next(tmp_path, tiny_model, reverse_data, live_cluster, prefect_api, retries):
    """Tried: the trainer SIGKILLed at the first scoring call of step 3 (a reward function that kills
    the process named in a kill file, armed as soon as the trainer's process exists). Before: Ray's
    `ValueError: Failed to look up actor` under three tracebacks. Now the console and the run log say
    that trainer rank 0 was lost in step 3, and then either that the run retries from the step-2
    checkpoint (it does, and ends with exit code 0), or, with no flow retry, that the run ends and
    `--resume` continues from that checkpoint (exit code 1; the resumed run then finishes)."""
    name = f"lost{retries}"
    shutil.copy(ROOT / "tests" / "fault_rewards.py", tmp_path / "fault_rewards.py")
    kill_file = tmp_path.parent / f"{tmp_path.name}-kill"  # outside the project folder, whose code is shipped
    settings = dict(reward={"function": "fault_rewards:kill_once"},
                    cluster={"home": str(live_cluster["home"]), "flow_retries": retries,
                             "runtime_env": {"env_vars": {"TRELLIS_TEST_KILL_FILE": str(kill_file)}}})
    head = psutil.Process(live_cluster["pid"])

    def trainer_pids() -> set[int]:
        found = set()
        for process in head.children(recursive=True):
            try:
                if "ray::TrainerActor" in " ".join(process.cmdline()):
                    found.add(process.pid)
            except psutil.Error:
                continue
        return found

    def started_at(pid: int) -> float:
        try:
            return psutil.Process(pid).create_time()
        except psutil.Error:
            return 0.0

    before, armed = trainer_pids(), []  # trainers of earlier tests' runs, left by their failures

    def arm() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not armed:
            new = trainer_pids() - before
            if new:
                # Normally one; a trainer of an earlier run still being torn down may show too: this run's is the newest.
                pid = max(new, key=started_at)
                kill_file.write_text(f"{pid} {2 * 16 * 8}")  # after steps 1-2's 256 scoring calls
                armed.append(pid)
            time.sleep(0.05)

    arming = threading.Thread(target=arm, daemon=True)
    arming.start()
    result = train(tmp_path, name, tiny_model, reverse_data, live_cluster, **settings)
    arming.join(timeout=5)

    assert armed and not kill_file.exists(), "the trainer was not killed"
    assert not psutil.pid_exists(armed[0])
    failed = [line for line in console(result) if line.startswith("error")]
    assert "Traceback" not in result.stdout + result.stderr and "look up actor" not in result.stdout + result.stderr
    log = run_log(tmp_path, name)
    # Which words depend on when the driver meets the death: a call already waiting on the trainer ends
    # with Ray's ActorDiedError; a call made after Ray has freed the name finds no actor. Both are the loss.
    named = [cause for cause in LOST_TRAINER_CAUSES if f" ERROR step 3 failed: trainer rank 0 ({name}-trainer) was lost: {cause}; " in log]
    assert len(named) == 1, log
    lost = f"error: step 3 failed: trainer rank 0 ({name}-trainer) was lost: {named[0]}; "
    assert LOST_TRAINER_CAUSES[named[0]] in "\n".join(traceback_lines(log))  # Ray's own words, kept for the operator
    (run,) = flow_runs(f"rl_run[{name}]")
    if retries:
        assert result.returncode == 0, result.stdout + result.stderr
        assert failed == [lost + "retrying from the step-2 checkpoint (attempt 2 of 2)"], result.stdout + result.stderr
        assert (run.run_count, run.state_name) == (2, "Completed")
        assert " WARNING attempt 2 of the run (a Prefect retry): from checkpoint " in log
        assert "differ from this run" not in log  # the controller and the rollout worker were kept
    else:
        assert result.returncode == 1, result.stdout + result.stderr
        assert failed == [lost + "the run ends: cluster.flow_retries is 0; resume from the step-2 checkpoint with --resume"]
        assert (run.run_count, run.state_name) == (1, "Failed")
        resumed = train(tmp_path, name, tiny_model, reverse_data, live_cluster, "--resume", **settings)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "runs" / name / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == [1, 2, 3, 4]


JUDGE_REWARD = '''
"""A reward whose judge refuses the run's workers: it imports where the run is launched and in the
cluster's environment probe (a Ray task), and raises, quoting the credentials it tried, in the run's
controller (a Ray actor), as a judge reachable from a laptop but not from the cluster would."""
import os

import ray

if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
    raise PermissionError(
        f"the judge refused key {os.environ['AWS_SECRET_ACCESS_KEY']} and token {os.environ['JUDGE_API_TOKEN']}"
    )


def score(sample):
    return 0.0
'''


def test_secrets_in_a_workers_error_are_masked_on_the_console_in_the_run_log_and_in_prefect(
    tmp_path, tiny_model, reverse_data, live_cluster, prefect_api
):
    """Tried: an AWS secret key and an API token in the launching shell, forwarded to the workers
    (`cluster.forward_env`), and a reward module that raises with both in its message in the run's
    controller. Neither value reaches the console, the run log (line and traceback), the failed
    states of the Prefect flow and task runs, or the flow run's logs on the Prefect API; the mask does."""
    from trellis.engine.secrets import REDACTED

    secrets = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-K7MDENG-worker-side", "JUDGE_API_TOKEN": "judge-tok-0f9e8d7c6b5a4"}
    (tmp_path / "judge_reward.py").write_text(JUDGE_REWARD)
    result = train(tmp_path, "judged", tiny_model, reverse_data, live_cluster, env=secrets,
                   reward={"function": "judge_reward:score"},
                   cluster={"home": str(live_cluster["home"]), "forward_env": ["JUDGE_API_TOKEN"]})

    assert result.returncode == 2, result.stdout + result.stderr
    (shown,) = console(result)
    assert re.fullmatch(
        re.escape("error: the run's start failed: the controller (judged-controller) failed while it was built: "
                  "'judge_reward:score': importing 'judge_reward' failed: PermissionError: the judge refused key "
                  f"{REDACTED} and token {REDACTED} (at ") + r"\S+/judge_reward\.py:\d+\)" + re.escape(
                  "; the run ends: change that setting (a setting error is not retried)"), shown), shown
    log = run_log(tmp_path, "judged")
    assert f"PermissionError: the judge refused key {REDACTED} and token {REDACTED}" in "\n".join(traceback_lines(log))
    (run,) = flow_runs("rl_run[judged]")
    (outer,) = flow_runs("rl_train[judged]")
    states = [run.state.message, outer.state.message, *(r.state.message for r in task_runs(run.id))]
    assert any(f"key {REDACTED} and token {REDACTED}" in message for message in states[:2]), states
    logs = flow_run_logs(run.id)
    assert any(REDACTED in message for message in logs), logs
    for value in secrets.values():
        assert value not in result.stdout + result.stderr
        assert value not in log
        assert not any(value in (message or "") for message in states)
        assert not any(value in message for message in logs)
