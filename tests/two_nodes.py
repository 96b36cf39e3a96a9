"""A second Ray node on this machine, joined to the session's private head (the ``ray_cluster``
fixture): tests show trellis with actors on two nodes of one cluster.

    from two_nodes import second_node

    def test_something(ray_cluster, tmp_path):
        with second_node(ray_cluster, tmp_path) as node_id:
            ...  # two alive nodes; the new one offers 1 CPU and the resource ``trellis_node2``
        # the node is gone again: later tests see the head alone

The node is ``ray start --address=... --block`` (``engine.cluster.head.worker_node_command``) in a
session of its own; leaving the block sends that process SIGTERM and waits until the cluster
reports the node dead. Actors still on the node die with it (detached ones too); a placement
group with a bundle there is rescheduled, or stays pending, so remove those first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray

from trellis.engine.cluster.head import head_environment, worker_node_command
from trellis.engine.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[1]
NODE2 = "trellis_node2"  # the custom resource the second node offers by default: pin work there with it
_UP_TIMEOUT_S = 90.0
_DOWN_TIMEOUT_S = 60.0


def alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node["Alive"]]


@contextmanager
def second_node(
    ray_cluster_info: dict, tmp_path: Path, num_cpus: int = 1, resources: dict[str, float] | None = None, *,
    object_store_memory: int = 200 * 1024 * 1024, config: ClusterConfig | None = None,
) -> Iterator[str]:
    """Start a second node against the head of ``ray_cluster_info`` (the ``ray_cluster`` fixture's
    value; this process must be connected to it), yield its node id once ``ray.nodes()`` shows it
    alive, and stop it on exit. ``resources`` defaults to ``{"trellis_node2": 1}``; ``config`` is
    the head's (for its auth token), by default the fixture's. The node's output goes to
    ``tmp_path / "node2.log"``."""
    address = ray_cluster_info["address"]
    config = config or ClusterConfig(head_port=int(address.rsplit(":", 1)[1]), num_cpus=2, home=ray_cluster_info["home"])
    resources = {NODE2: 1} if resources is None else resources
    before = {node["NodeID"] for node in alive_nodes()}
    log_path = Path(tmp_path) / "node2.log"
    command = worker_node_command(
        config, address, num_cpus=num_cpus, resources=resources, object_store_memory=object_store_memory,
    )
    with open(log_path, "ab") as log:
        node = subprocess.Popen(
            command, env={**os.environ, **head_environment(config)}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT,
        )
    try:
        node_id = _wait_up(node, before, log_path)
    except BaseException:
        _stop(node)
        raise
    try:
        yield node_id
    finally:
        _stop(node)
        _wait_dead(node_id)


def _wait_up(node: subprocess.Popen, before: set[str], log_path: Path) -> str:
    deadline = time.monotonic() + _UP_TIMEOUT_S
    while True:
        new = [n["NodeID"] for n in alive_nodes() if n["NodeID"] not in before]
        if new:
            return new[0]
        if node.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"The second Ray node did not join (exit code {node.poll()}); {log_path}:\n{tail}")
        time.sleep(0.2)


def _stop(node: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block`, which stops its raylet and agents; SIGKILL to its whole
    session if it has not ended within the limit."""
    if node.poll() is not None:
        return
    node.send_signal(signal.SIGTERM)
    try:
        node.wait(timeout=_DOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=10)


def _wait_dead(node_id: str) -> None:
    deadline = time.monotonic() + _DOWN_TIMEOUT_S
    while any(n["NodeID"] == node_id for n in alive_nodes()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"The cluster still shows node {node_id} alive {_DOWN_TIMEOUT_S:.0f} s after it stopped.")
        time.sleep(0.2)
