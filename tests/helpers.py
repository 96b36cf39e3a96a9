"""Small helpers shared by the checkpoint, fault, storage and several-rank tests."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import fsspec

from trellis.engine.config.loading import load_config
from trellis.engine.parquet_reads import read_parquet


def worker_config(tiny_model, reverse_data, **changes):
    """A training worker's config on the session's tiny model: 16 prompts, batches of 8, four steps."""
    return load_config(
        None,
        load_from=str(tiny_model),
        train_dataset={"path": str(reverse_data["train"]), "limit": 16, "max_prompt_length": 64},
        reward={"function": "trellis.engine.tiny.reverse_task:score"},
        total_train_steps=4,
        train_batch_size=8,
        **changes,
    )


def tiny_config(tiny_model, reverse_data, work_dir, **changes):
    """The example config on the session's tiny model: 16 prompts x 8 samples per step."""
    base = dict(
        load_from=str(tiny_model),
        train_dataset={"path": str(reverse_data["train"]), "max_prompt_length": 64},
        eval_dataset={"path": str(reverse_data["eval"]), "max_prompt_length": 64, "limit": 32},
        work_dir=str(work_dir),
        total_train_steps=4,
        evaluate_step=2,
        checkpoint_interval=2,
        checkpoint_maxkeep=-1,
        hf_interval=-1,
        hf_max_keep=-1,
        auto_resume=False,
        exp_tracker="jsonl",
    )
    return load_config("configs/tiny_reverse.yaml", **{**base, **changes})


class Crash(Exception):
    pass


def run_local(config, *, steps: int | None = None, resume: bool = False):
    """Run ``config`` in process to the end, or crash right after step ``steps``; the finished LocalRun."""
    from trellis.engine.run.local import LocalRun

    def crash_after(report) -> None:
        if report.step == steps:
            raise Crash

    with LocalRun(config, resume=resume) as local:
        try:
            local.run(crash_after)
        except Crash:
            pass
    return local


def sampled_groups(model, config, prompts) -> list:
    """``prompts`` x 8 samples from ``model`` with the transformers loop, scored by the config's reward."""
    from transformers import AutoTokenizer

    from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
    from trellis.engine.rollout.production.produce import rollout_groups, sampling_params
    from trellis.engine.rollout.rewards.runner import RewardRunner

    with RewardRunner(config.reward) as rewards:
        produced = rollout_groups(
            [(0, prompt) for prompt in prompts], repeat=8, backend=TransformersRollout(str(model), AutoTokenizer.from_pretrained(model)),
            rewards=rewards, params=sampling_params(config.rollout, seed=0), train_step=1, id_prefix="t-",
        )
    return produced.groups


WALL_CLOCK = ("time/", "throughput/", "goodput/")  # metric prefixes whose figures come from timing


def logged_metrics(config) -> dict[int, dict[str, float]]:
    """metrics.jsonl by step, without wall-clock figures (time/*, throughput/*, goodput/*), which differ run to run."""
    with fsspec.open(f"{config.run_uri}/logs/metrics.jsonl", "r", **config.storage_options) as handle:
        records = [json.loads(line) for line in handle.read().splitlines()]
    return {
        r["step"]: {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in records
    }


def lake_rows(config, split: str = "train") -> list[dict[str, Any]]:
    """Every stored row of a split, ordered by rollout id, without what names the run that wrote it (the
    run's name, its flow run and the URIs of its checkpoints differ between runs)."""
    fs, root = fsspec.core.url_to_fs(f"{config.run_uri}/trajectories/split={split}", **config.storage_options)
    fs.invalidate_cache()
    rows = []
    for path in sorted(fs.glob(f"{root}/step=*/part-0.parquet")):
        rows.extend(read_parquet(fs, path).to_pylist())
    for row in rows:
        for name in ("run", "flow_run_id", "checkpoint"):
            row.pop(name)
    return sorted(rows, key=lambda r: r["rollout_id"])


def ledger_check(config) -> str:
    """`trellis ledger check` on the run, as an operator runs it: asserts it passed (every prompt drawn
    is open or ended exactly once) and that no group was trained in part; returns what it printed."""
    import duckdb

    trellis = str(Path(sys.executable).with_name("trellis"))
    result = subprocess.run([trellis, "ledger", "check", config.run_uri], capture_output=True, text=True, timeout=300)
    print(result.stdout)  # shown with the test's output (-s, or when it fails)
    assert result.returncode == 0, result.stdout + result.stderr
    groups = f"read_parquet('{config.run_uri}/ledger/groups/*/*.parquet')"
    assert duckdb.sql(f"SELECT group_id, samples FROM {groups} WHERE samples != {config.prompt_repeat_k}").fetchall() == []
    return result.stdout


def finished_epochs(check_output: str) -> int:
    """How many epochs `trellis ledger check` printed as finished."""
    return sum(line.endswith("finished") for line in check_output.splitlines())


def flow_runs(name: str) -> list:
    """The Prefect flow runs called ``name`` (e.g. ``rl_run[experiment]``) on the current API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [name]}))

    return asyncio.run(read())


@contextmanager
def moto_s3_server() -> Iterator[str]:
    """moto's S3-compatible server on a free loopback port, up and answering; yields its endpoint URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    try:
        while True:
            try:
                fsspec.filesystem("s3", key="k", secret="s", endpoint_url=endpoint).ls("")
                break
            except Exception:
                assert time.time() < deadline and server.poll() is None, "moto_server did not come up"
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


@contextmanager
def fit_on_trainer_ranks(config, batch) -> Iterator[tuple[Any, list]]:
    """``batch`` fitted as step 1 by the run's trainer ranks (``train_resources.num_workers``, gloo on
    CPU): yields the ranks' fit results and the run's workers, which are released afterwards."""
    import ray

    from trellis.engine.cluster.workers import RunWorkers
    from trellis.engine.train.worker import TrainingWorker

    workers = RunWorkers(config)
    workers.attach()
    try:
        ranks = workers.actors("trainer")
        yield workers.wait([rank.call.remote(TrainingWorker.fit, ray.put(batch), 1) for rank in ranks]), workers
    finally:
        workers.release()
