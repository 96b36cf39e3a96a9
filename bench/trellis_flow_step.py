"""trellis's full orchestrated step: Prefect flow runs driving Ray actors on a local head it starts.

Usage: python bench/trellis_flow_step.py MODEL_DIR TRAIN_PARQUET STEPS OUT_JSON [attest|no-attest]
A first flow run of 3 steps warms the workers up and keeps them; a second flow run re-attaches and
runs STEPS more, which are the ones measured: wall seconds between consecutive `rl_step` flow-run
starts (everything the user waits for), CPU seconds of the whole process tree (Prefect's server and
Ray's processes included), and the orchestration overhead: the part of each step interval in which
no worker ran a method (Ray's timeline), i.e. the workers waited on Prefect and the driver.
Weight-sync attestation follows the config's default (off where the rollout runs on CPU) unless the
fifth argument says ``attest`` or ``no-attest`` (bench/attest_cost.py); the next step's rollout is launched
early where the config's default says, unless ``TRELLIS_BENCH_OVERLAP`` is 1 or 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trellis.flows.prefect_settings import use_lean_temporary_server  # noqa: E402

if os.environ.get("TRELLIS_BENCH_PREFECT_DEFAULTS") != "1":  # 1: Prefect's own defaults, for comparison
    use_lean_temporary_server()
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

import ray  # noqa: E402
from _measure import StepClock, busy_spans, idle_seconds  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.sorting import FlowRunSort  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402

from trellis.engine.config import TrellisConfig  # noqa: E402
from trellis.engine.config.loading import load_config  # noqa: E402
from trellis.engine.run.plan import ROLES  # noqa: E402
from trellis.flows.rl_train import rl_train  # noqa: E402

WARMUP_STEPS = 3
PHASES = ("time/rollout", "time/produce_batch", "time/prepare_data", "time/fit", "time/sync_weights", "time/attest", "time/evaluate")
# What a worker's call is named in Ray's timeline: its actor class (a method called by name), or its role for
# a phase's call (``controller.produce_batch``, named so since cffc789: without the roles, every phase counted
# as idle time).
WORKER_CALLS = ("TrainerActor", "RolloutActor", "ControllerActor", *ROLES)


def start_head(*extra_args: str) -> tuple[subprocess.Popen, str]:
    # A loopback head private to the bench. Ray 2.60 turns token auth on for a new head when
    # ~/.ray/auth_token exists (another program's local ray.init() writes one, e.g. verl's), and this
    # process and `ray status` would then be refused; say which mode every process here uses.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray, "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                             "--disable-usage-stats", *extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while (status := subprocess.run([ray, "status", f"--address={address}"], capture_output=True, text=True)).returncode != 0:
        if head.poll() is not None or time.monotonic() > deadline:
            head.kill()
            raise SystemExit(f"the bench's Ray head at {address} did not come up: {status.stderr.strip().splitlines()[-1:]}")
        time.sleep(0.5)
    return head, address


def overlap_next_rollout() -> bool | None:
    """TRELLIS_BENCH_OVERLAP=1 or 0 forces ``cluster.overlap_next_rollout`` (unset: the config's default)."""
    choice = os.environ.get("TRELLIS_BENCH_OVERLAP")
    return None if choice is None else choice == "1"


async def step_starts(since_s: float) -> dict[int, float]:
    """Start times of this bench's rl_step flow runs (the local Prefect database keeps older ones)."""
    starts: dict[int, float] = {}
    async with get_client() as client:
        offset = 0
        while True:  # newest first, a page of the API's largest size at a time, back to the first run before since_s
            runs = await client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=200, offset=offset)
            for run in runs:
                if run.name.startswith("rl_step[step=") and run.start_time is not None and run.start_time.timestamp() >= since_s:
                    starts[int(run.name.split("=")[1].rstrip("]"))] = run.start_time.timestamp()
            if len(runs) < 200 or any(run.start_time is not None and run.start_time.timestamp() < since_s for run in runs):
                return starts
            offset += 200


def flow_step_config(model_dir: str, train_path: str, work_dir: str, address: str, *, overlap: bool | None = None,
                     attest: bool | None = None, health_check_interval: int = 0) -> TrellisConfig:
    """The measured flow step's config (the one the flow benches share), for WARMUP_STEPS steps on the Ray head
    at ``address``; the workers stay up after the run, so that the next ``rl_train`` re-attaches."""
    return load_config(
        None, load_from=model_dir, train_dataset={"path": train_path}, total_train_steps=WARMUP_STEPS,
        reward={"function": "trellis.engine.tiny.reverse_task:score"},
        train_batch_size=16, prompt_repeat_k=8,
        optim={"lr": 3e-4, "max_grad_norm": 1.0}, work_dir=work_dir, experiment_name="bench", exp_tracker="jsonl",
        cluster={"address": address, "release_workers_at_end": False, "overlap_next_rollout": overlap},
        attest={"enabled": attest},
        rollout={"temperature": 1.0, "max_new_tokens": 8, "health_check": {"interval": health_check_interval}},
    )


def main(model_dir: str, train_path: str, steps: int, out: str, attest: bool | None = None) -> None:
    head, address = start_head()
    try:
        with tempfile.TemporaryDirectory() as tmp, temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            # TRELLIS_BENCH_HEALTH_CHECK=1: the rollout health check's task every step (off on CPU by default), for
            # what it costs the step (cpu_step.py).
            config = flow_step_config(model_dir, train_path, tmp, address, overlap=overlap_next_rollout(), attest=attest,
                                      health_check_interval=int(os.environ.get("TRELLIS_BENCH_HEALTH_CHECK", "0")))
            rl_train(config)
            clock = StepClock()
            since_s = time.time()
            clock.start()
            rl_train(config.model_copy(update={"total_train_steps": WARMUP_STEPS + steps}))
            clock.stop()
            starts = asyncio.run(step_starts(since_s))
            records = {r["step"]: r for r in map(json.loads, (Path(tmp) / "bench" / "logs" / "metrics.jsonl").read_text().splitlines())}
            measured = range(WARMUP_STEPS + 1, WARMUP_STEPS + steps)  # the last step has no successor start
            wall = [starts[s + 1] - starts[s] for s in measured]
            spans = busy_spans(ray.timeline(), WORKER_CALLS)
            overhead = [idle_seconds(spans, starts[s], starts[s + 1]) for s in measured]
            phases = [{p: records[s].get(p, 0.0) for p in PHASES} for s in measured]
        clock.wall = wall
        clock.cpu = [clock.cpu[0] / steps] * len(wall)
        clock.dump(out, overhead=overhead, phases=phases, rewards=[records[s]["response/rewards/mean"] for s in measured])
    finally:
        ray.shutdown()  # disconnect first, or the driver waits a minute for the stopped head and dies
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=60)


if __name__ == "__main__":
    choice = sys.argv[5] if len(sys.argv) > 5 else "default"
    if choice not in ("attest", "no-attest", "default"):
        raise SystemExit(f"the fifth argument is attest or no-attest, not {choice!r}")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], attest={"attest": True, "no-attest": False}.get(choice))
