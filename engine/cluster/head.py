"""The Ray cluster trellis runs on: attach to a running one, or start a persistent, private local head.

Resolution order for the address: ``cluster.address`` in the config, then ``RAY_ADDRESS``, then the
head that ``trellis cluster up`` (or an earlier run) started and recorded under ``cluster.home``,
then a new local head. ``ray.init(address="auto")`` is avoided on purpose: where it finds nothing it
silently starts a cluster of its own, and named actors would not outlive the process.

A Ray cluster runs any code that reaches it (the ShadowRay attacks, CVE-2023-48022), so the head
trellis starts is private: every Ray process of it listens on 127.0.0.1 only, and it asks every
client for a token kept in ``{cluster.home}/ray-auth-token`` (mode 0600). To open a cluster to other
nodes, start it yourself on a private network (docs/cluster-and-security.md: *A cluster of several machines*).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import ray

from trellis.engine.cluster.compat import use_private_ray_head
from trellis.engine.config import ClusterConfig

_START_TIMEOUT_S = 180.0


class ClusterError(RuntimeError):
    pass


def _ray_cli() -> str:
    found = Path(sys.executable).with_name("ray")
    if not found.exists():
        raise ClusterError("The `ray` command is not installed beside this Python; install trellis with its dependencies.")
    return str(found)


def _home(config: ClusterConfig) -> Path:
    return Path(config.home).expanduser()


def auth_token_file(config: ClusterConfig) -> Path:
    """The private head's token, made on first use, readable by this user only."""
    token = _home(config) / "ray-auth-token"
    if not token.exists():
        token.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_hex(32))
    return token


def head_environment(config: ClusterConfig) -> dict[str, str]:
    """What every Ray process and command of the private head runs with: one machine (so loopback
    stays loopback) and token authentication."""
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(auth_token_file(config)),
    }


def head_command(config: ClusterConfig, port: int, *, block: bool = True) -> list[str]:
    command = [
        _ray_cli(), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
        "--disable-usage-stats", f"--num-cpus={config.num_cpus or os.cpu_count() or 1}",
    ]
    return [*command, "--block"] if block else command


def is_alive(address: str, config: ClusterConfig) -> bool:
    env = {**os.environ, **(head_environment(config) if is_loopback(address) else {})}
    result = subprocess.run([_ray_cli(), "status", f"--address={address}"], capture_output=True, text=True, timeout=60, env=env)
    return result.returncode == 0


def is_loopback(address: str) -> bool:
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _record_file(config: ClusterConfig) -> Path:
    return _home(config) / "ray-head.json"


def _record(config: ClusterConfig) -> dict:
    record = _record_file(config)
    return json.loads(record.read_text()) if record.exists() else {}


def recorded_address(config: ClusterConfig) -> str | None:
    """The address of the local head that trellis started and recorded under ``cluster.home``."""
    return _record(config).get("address")


def start_head(config: ClusterConfig) -> str:
    """Start a private local head that outlives this process (``ray start --block`` in a session of
    its own, so that stopping it stops exactly this cluster) and record its address and process."""
    address = f"127.0.0.1:{config.head_port}"
    home = _home(config)
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "ray-head.log", "ab") as log:
        head = subprocess.Popen(
            head_command(config, config.head_port), env={**os.environ, **head_environment(config)},
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not is_alive(address, config):
        if head.poll() is not None or time.monotonic() > deadline:
            head.kill()
            tail = (home / "ray-head.log").read_text(errors="replace")[-2000:]
            raise ClusterError(f"The local Ray head did not start (see {home / 'ray-head.log'}):\n{tail}")
        time.sleep(0.5)
    _record_file(config).write_text(json.dumps({"address": address, "pid": head.pid}))
    return address


def stop_head(config: ClusterConfig) -> bool:
    """Stop the head trellis recorded (and the run workers on it); False when none was running."""
    record = _record(config)
    _record_file(config).unlink(missing_ok=True)
    pid = record.get("pid")
    if pid is None:  # recorded by a trellis before 0.2, which started heads with `ray start` alone
        if record.get("address"):
            subprocess.run([_ray_cli(), "stop"], capture_output=True, text=True, timeout=120)
        return bool(record)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _exited(pid):
            return True
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)
    return True


def _exited(pid: int) -> bool:
    """Whether ``pid`` is gone. A head this process started stays a zombie after it exits, which
    signal 0 still finds, until it is waited for: reap it here."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:  # started by another process (`trellis cluster up`)
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def resolve_address(config: ClusterConfig, *, start_if_missing: bool = True) -> str:
    for address in (config.address, os.environ.get("RAY_ADDRESS")):
        if address:
            return address
    address = running_head(config)
    if address:
        return address
    if not start_if_missing:
        raise ClusterError("No Ray cluster is running; start one with `trellis cluster up`.")
    return start_head(config)


def running_head(config: ClusterConfig) -> str | None:
    """The address of the head recorded under ``cluster.home`` while it runs: its ``ray start --block``
    process lives and its GCS port takes a connection. Asked at every run's start, where ``ray status``
    (a new Python process, ~2 s) would say the same; a record without the process (before trellis 0.2)
    asks it."""
    record = _record(config)
    address, pid = record.get("address"), record.get("pid")
    if not address:
        return None
    if pid is None:
        return address if is_alive(address, config) else None
    if _exited(pid):
        return None
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return address
    except OSError:
        return None


def connect(config: ClusterConfig) -> str:
    """Connect this process to the cluster (once); return its address."""
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    address = resolve_address(config)
    if is_loopback(address):
        use_private_ray_head(str(auth_token_file(config)))
    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    return address


# `ray start` for a node that joins a private head from the same machine. With
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (what keeps every loopback address loopback) `ray start`
# refuses any non-head node; with it on, it turns 127.0.0.1 (the head's address and the node's own)
# into the machine's network address, where the private head does not listen. So the CLI runs with
# the setting off, as every process of the head does, and only its own refusal is lifted: the
# scripts module alone sees ENABLE_RAY_CLUSTER on; the address resolution (ray._private.services)
# and the node's processes, which inherit the environment, keep loopback.
_JOIN_ON_LOOPBACK = """\
import sys, types
from ray._private import ray_constants
from ray.scripts import scripts

class _Constants(types.ModuleType):
    def __getattr__(self, name):
        return getattr(ray_constants, name)

constants = _Constants(ray_constants.__name__)
constants.ENABLE_RAY_CLUSTER = True
scripts.ray_constants = constants
sys.argv[0] = "ray"
scripts.main()
"""


def worker_node_command(
    config: ClusterConfig, head_address: str, *, num_cpus: int, resources: dict[str, float] | None = None,
    object_store_memory: int | None = None,
) -> list[str]:
    """`ray start --address=... --block` for a second node of the private head at ``head_address``,
    on this machine: run it with ``head_environment(config)`` (the head's token), in a session of its
    own; SIGTERM to that process stops exactly this node.

    Its ports are all picked by the system, so that they do not collide with the head's: node
    manager, object manager, metrics and runtime-env agent already default to that; the dashboard
    agent's HTTP port (52365) and the workers' range (10002-19999) are fixed by default and are
    set to 0 here, as ``ray.cluster_utils.Cluster`` does for its nodes. The node shares the head's
    temp dir and session (its sockets and logs get their own names there), so it starts no log
    monitor of its own: the head's already forwards that session's logs."""
    if not is_loopback(head_address) or head_address.startswith("ray://"):
        raise ClusterError(f"A node on this machine joins a private head on loopback, not {head_address}.")
    command = [
        sys.executable, "-c", _JOIN_ON_LOOPBACK, "start", f"--address={head_address}", "--node-ip-address=127.0.0.1",
        f"--num-cpus={num_cpus}", "--min-worker-port=0", "--max-worker-port=0", "--dashboard-agent-listen-port=0",
        "--include-log-monitor=false", "--disable-usage-stats",
    ]
    if resources:
        command.append(f"--resources={json.dumps(resources)}")
    if object_store_memory is not None:
        command.append(f"--object-store-memory={object_store_memory}")
    return [*command, "--block"]
