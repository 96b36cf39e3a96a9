"""Shared fixtures: the tiny model is built once per session, offline, exactly as users build it."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock

from trellis.engine.tiny import lookup_task
from trellis.engine.tiny.model import build_tiny_checkpoint
from trellis.engine.tiny.reverse_task import EVAL_SEED_OFFSET, write_dataset


def pytest_configure(config):
    """Prefect keeps its database and settings under PREFECT_HOME (~/.prefect): this session, and every
    process it starts (`trellis train` with a temporary server), keep theirs in a folder of their own,
    removed at the end. Set here, before a test module imports Prefect, which reads its settings once."""
    folder = tempfile.mkdtemp(prefix="trellis-tests-prefect-")
    environment = pytest.MonkeyPatch()
    environment.setenv("PREFECT_HOME", folder)
    # `make test` runs two test processes, each with its runs' workers, on the 2 cores: with torch on
    # every core in each, their threads spun against each other. One thread each (this process, the
    # `trellis` commands and Ray heads it starts, their workers): a slice of the suite (test_faults,
    # test_worker_errors, test_gateway) took 6:16 instead of 10:28, the lookup model's warm-up 65 s
    # instead of 314 s.
    environment.setenv("TRELLIS_TORCH_THREADS", "1")
    environment.setenv("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    config.add_cleanup(environment.undo)  # cleanups run last first: the variable goes, then the folder


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``build(folder)`` run once per test session: `make test` runs two test processes (pytest-xdist),
    and the first to ask builds in a folder of the session's that both see while the other waits for it
    (the lookup model's warm-up takes 2-3 minutes on one thread, and was paid in each process)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: its own temporary folder
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    folder = tmp_path_factory.getbasetemp().parent / f"shared-{name}"  # the session's, above each worker's own
    with FileLock(str(folder) + ".lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a process that died mid-build left
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "tiny", lambda folder: build_tiny_checkpoint(folder / "model")) / "model"


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {
        "train": write_dataset(root / "train.parquet", 4096, seed=0),
        "eval": write_dataset(root / "eval.parquet", 512, seed=EVAL_SEED_OFFSET),
    }


@pytest.fixture(scope="session")
def lookup(tmp_path_factory) -> dict[str, Path]:
    """The bundled multi-turn task: its warmed-up model and prompts, as `trellis tiny-model --task lookup` makes them."""
    def build(root: Path) -> None:
        lookup_task.build_checkpoint(root / "model")
        lookup_task.write_dataset(root / "train.parquet", 4096, seed=0)
        lookup_task.write_dataset(root / "eval.parquet", 512, seed=lookup_task.EVAL_SEED_OFFSET)

    root = built_once(tmp_path_factory, "lookup", build)
    return {"model": root / "model", "train": root / "train.parquet", "eval": root / "eval.parquet"}


ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ends_with_this_process():
    """A preexec_fn that has the kernel send the child SIGTERM when this process ends, however it ends:
    pytest-timeout ends a hung session with os._exit, which runs no fixture's teardown (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    return lambda: prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


# What use_private_ray_head sets in this process's environment.
_PRIVATE_HEAD_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real, private head (loopback only, token auth) as trellis starts it, with `ray start --block`:
    ending that process stops exactly this cluster. Its cluster home (the token) is a folder of the
    session's, never the user's ~/.trellis: a process the test starts reaches it with
    ``cluster.home={home}`` (``cluster`` holds address and home as config keys)."""
    import ray  # here, so that engine-only tests run where Ray is not installed (the GPU machine)

    from trellis.engine.cluster.compat import use_private_ray_head
    from trellis.engine.cluster.head import auth_token_file, head_command, head_environment, is_alive
    from trellis.engine.config import ClusterConfig

    port = _free_port()
    home = tmp_path_factory.mktemp("cluster-home")
    cluster = ClusterConfig(head_port=port, num_cpus=2, home=str(home))
    kill_file = tmp_path_factory.mktemp("faults") / "kill-pid"
    head = subprocess.Popen(
        head_command(cluster, port), env={**os.environ, **head_environment(cluster)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=ROOT,
        preexec_fn=_ends_with_this_process(),
    )
    address = f"127.0.0.1:{port}"
    deadline = time.time() + 90
    while not is_alive(address, cluster):
        assert time.time() < deadline and head.poll() is None, "the Ray head did not come up"
        time.sleep(0.5)
    with pytest.MonkeyPatch.context() as environment:  # what use_private_ray_head sets goes when the cluster goes
        for name in _PRIVATE_HEAD_ENV:
            environment.delenv(name, raising=False)  # this head's token, whatever the shell names
        use_private_ray_head(str(auth_token_file(cluster)))
        # Workers import the fault-injecting reward functions from tests/.
        env = {"PYTHONPATH": str(ROOT / "tests"), "TRELLIS_TEST_KILL_FILE": str(kill_file)}
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
        yield {"address": address, "kill_file": kill_file, "pid": head.pid, "home": str(home),
               "cluster": {"address": address, "home": str(home)}}
        ray.shutdown()
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=60)


def _cluster_holdings() -> tuple[set[tuple[str, str]], set[str]]:
    """The live named actors (namespace, name) and the placement groups not removed, on the connected cluster."""
    import ray

    actors = {(entry["namespace"], entry["name"]) for entry in ray.util.list_named_actors(all_namespaces=True)}
    groups = {group_id for group_id, info in ray.util.placement_group_table().items() if info.get("state") != "REMOVED"}
    return actors, groups


@pytest.fixture(autouse=True)
def _cluster_left_as_found(request):
    """A test on the shared cluster that fails before it releases its run leaves detached actors and
    placement groups holding the cluster's 2 CPUs: every later run would wait for a placement that
    never comes (ray_get_timeout_s, retried) until the suite's timeout. What a test made and left is
    released after it and named in its output; what existed before (a module's run) stays."""
    if "ray_cluster" not in request.fixturenames:
        yield
        return
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    actors_before, groups_before = _cluster_holdings()
    yield
    if not ray.is_initialized():
        return
    actors_after, groups_after = _cluster_holdings()
    left_actors, left_groups = actors_after - actors_before, groups_after - groups_before
    if not (left_actors or left_groups):
        return
    print(f"released after {request.node.name}: actors {sorted(name for _, name in left_actors)}, {len(left_groups)} placement group(s)")
    for namespace, name in left_actors:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # gone meanwhile
            pass
    for group_id in left_groups:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))


@pytest.fixture(scope="module")
def prefect_api():
    """A temporary Prefect API for the module's flow runs (heartbeats off: nothing here needs them)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    # Its default 30 s for the server to come up was seen exceeded on 2 busy cores (a fresh venv compiles
    # Prefect's server modules on its first start), failing every module that shares the server.
    with prefect_test_harness(server_startup_timeout=180), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.WARNING)


@pytest.fixture(autouse=True)
def _torch_modes_restored():
    """A run in this process (LocalRun) sets torch's threads and, with ``deterministic``, its
    deterministic mode for the whole process (engine.devices.set_up_process): both go back after each
    test, so that no test runs in a mode an earlier one left."""
    import torch

    threads = torch.get_num_threads()
    deterministic, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


# The fast lane, `pytest -m "not slow"`: a test is slow when it uses one of these fixtures, which start
# real services (a Ray head, a Prefect server, a cluster through the CLI) and run flows on them...
SLOW_FIXTURES = frozenset({"ray_cluster", "prefect_api", "live_cluster"})
# ...or when it trains in this process or a `trellis` one (a LocalRun, itself or in its module's fixture):
# test_checkpoint's took 2-7 min each with the 2 cores ~9x oversubscribed. A module path marks all its tests.
SLOW_TESTS = frozenset({
    "tests/test_checkpoint.py::test_an_interrupted_and_resumed_run_equals_an_uninterrupted_one",
    "tests/test_checkpoint.py::test_a_checkpoint_write_that_crashes_half_way_leaves_the_previous_one_to_resume",
    "tests/test_checkpoint.py::test_max_keep_for_checkpoints_and_hf_exports",
    "tests/test_checkpoint.py::test_the_hf_export_loads_with_from_pretrained_and_generates",
    "tests/test_checkpoint.py::test_a_checkpoint_without_optimizer_state_needs_an_explicit_choice",
    "tests/test_checkpoint.py::test_a_fresh_start_refuses_to_overwrite_checkpoints_and_incomplete_ones_are_refused",
    "tests/test_checkpoint.py::test_debug_rollout_then_debug_train_reproduces_the_first_step",
    "tests/test_cli.py::test_in_process_training_needs_no_cluster",
    "tests/test_dynamic_sampling.py::test_a_real_step_reports_the_counters_and_keeps_filtered_groups_in_the_lake",
    "tests/test_lake_shell.py",
    "tests/test_ledger.py::test_a_run_with_dynamic_sampling_ends_every_prompt_it_draws_once",
    "tests/test_ledger.py::test_the_check_names_a_lost_prompt_and_a_doubled_one_and_exits_1",
    "tests/test_ledger.py::test_an_asynchronous_run_with_dynamic_sampling_records_the_groups_its_producer_drops",
    "tests/test_ledger.py::test_groups_too_stale_after_a_resume_are_given_up_or_made_again",
    "tests/test_ledger.py::test_a_multi_task_run_keeps_a_ledger_per_task",
    "tests/test_ledger.py::test_the_check_reads_a_ledger_on_s3",
    "tests/test_learning.py",
    "tests/test_multi_task.py::test_two_tasks_mix_by_weight_each_with_its_loop_reward_and_sampling",
    "tests/test_multi_task.py::test_a_resumed_multi_task_run_draws_what_an_uninterrupted_one_does",
    "tests/test_multi_task.py::test_the_asynchronous_trainer_mixes_tasks_too",
    "tests/test_private_head.py",
    "tests/test_report.py",
})


def pytest_collection_modifyitems(config, items):
    slow_in_module: Counter[str] = Counter()
    for item in items:
        test, module = item.nodeid.split("[")[0], item.nodeid.split("::")[0]
        if SLOW_FIXTURES & set(item.fixturenames) or test in SLOW_TESTS or module in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
            slow_in_module[module] += 1
    # The modules with the most slow tests first. `make test` runs two processes that each take a whole
    # module at a time in this order (pytest-xdist's loadfile with --no-loadscope-reorder): the long
    # modules start first and the short ones fill in at the end, instead of a long one starting last
    # while the other process has nothing left to do. The sort is stable: a module keeps its tests' order.
    items.sort(key=lambda item: -slow_in_module[item.nodeid.split("::")[0]])
