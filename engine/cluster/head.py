"""The Ray cluster trellis runs on: attach to a running one, or start a persistent local head.

Resolution order for the address: ``cluster.address`` in the config, then ``RAY_ADDRESS``, then the
head that ``trellis cluster up`` (or an earlier run) started and recorded, then a new local head.
``ray.init(address="auto")`` is avoided on purpose: where it finds nothing it silently starts a
private cluster, and named actors would not outlive the process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import ray

from engine.config import ClusterConfig


class ClusterError(RuntimeError):
    pass


def _ray_cli() -> str:
    found = shutil.which("ray") or str(Path(os.sys.executable).with_name("ray"))
    if not Path(found).exists():
        raise ClusterError("The `ray` command is not installed; install trellis with its dependencies.")
    return found


def _record_file(config: ClusterConfig) -> Path:
    return Path(config.home).expanduser() / "ray-head.json"


def recorded_address(config: ClusterConfig) -> str | None:
    """The address of the local head that trellis started and recorded under ``cluster.home``."""
    record = _record_file(config)
    if not record.exists():
        return None
    return json.loads(record.read_text()).get("address")


def is_alive(address: str) -> bool:
    result = subprocess.run([_ray_cli(), "status", f"--address={address}"], capture_output=True, text=True, timeout=60)
    return result.returncode == 0


def start_head(config: ClusterConfig) -> str:
    """Start a persistent local head (it outlives this process) and record its address."""
    port = config.head_port
    command = [
        _ray_cli(), "start", "--head", f"--port={port}", "--include-dashboard=false", "--disable-usage-stats",
        f"--num-cpus={config.num_cpus or os.cpu_count() or 1}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        raise ClusterError(f"`ray start` failed:\n{result.stderr[-2000:]}")
    address = f"127.0.0.1:{port}"
    record = _record_file(config)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"address": address}))
    return address


def stop_head(config: ClusterConfig) -> None:
    subprocess.run([_ray_cli(), "stop"], capture_output=True, text=True, timeout=120)
    _record_file(config).unlink(missing_ok=True)


def resolve_address(config: ClusterConfig, *, start_if_missing: bool = True) -> str:
    for address in (config.address, os.environ.get("RAY_ADDRESS")):
        if address:
            return address
    address = recorded_address(config)
    if address and is_alive(address):
        return address
    if not start_if_missing:
        raise ClusterError("No Ray cluster is running; start one with `trellis cluster up`.")
    return start_head(config)


def connect(config: ClusterConfig) -> str:
    """Connect this process to the cluster (once); return its address."""
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    address = resolve_address(config)
    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    return address
