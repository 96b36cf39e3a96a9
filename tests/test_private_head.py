"""The private head trellis starts (engine/cluster/head.py) keeps strangers out: a Ray client without
its token, or with a wrong one, is refused; the token file is readable by its owner alone; every port
of the head listens on loopback. The head is started by ``start_head``, as `trellis cluster up` and a
run with no cluster of its own start it, in a cluster home of the test's own; every client is a
separate process, so the test driver's own Ray settings cannot help or hinder it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import psutil
import pytest

from conftest import _free_port
from trellis.engine.cluster.head import ClusterError, auth_token_file, recorded_address, resolve_address, start_head, stop_head
from trellis.engine.config import ClusterConfig

CONNECTED = "connected, and ran a task:"
# A client as a user writes it: attach to the address and run one task there.
CLIENT = f"""
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print({CONNECTED!r}, ray.get(ray.remote(lambda: 6 * 7).remote(), timeout=120), flush=True)
"""


@pytest.fixture(scope="module")
def private_head(tmp_path_factory):
    cluster = ClusterConfig(home=str(tmp_path_factory.mktemp("cluster-home")), head_port=_free_port(), num_cpus=1)
    address = start_head(cluster)
    yield cluster, address
    assert stop_head(cluster)


def client(address: str, home, **environment: str) -> subprocess.CompletedProcess:
    """A fresh Python process with none of this one's RAY_* settings and a home of its own (Ray's
    default token file, ~/.ray/auth_token, is looked up there). It keeps loopback as loopback, as
    trellis's own clients do: without that it would dial the machine's network address, where the
    private head does not listen, and be refused for that reason, not for its token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **environment)
    return subprocess.run([sys.executable, "-c", CLIENT, address], env=env, capture_output=True, text=True, timeout=300)


def test_a_client_without_the_token_or_with_a_wrong_one_is_refused(private_head, tmp_path):
    """Tried: no token at all (auth mode off, as a plain `ray.init` runs), and token mode with a token
    of the right form that is not the cluster's. Both must fail to connect with Ray's authentication
    error and run nothing; the same client given the head's token file connects and runs its task, so
    the refusals are about the token and nothing else."""
    cluster, address = private_head
    assert recorded_address(cluster) == address

    # A refused client retries its connection once a second, 20 times by default, before it gives up
    # with the authentication error; 2 tries give the same error.
    once = {"RAY_NUM_REDIS_GET_RETRIES": "2"}
    without = client(address, tmp_path, **once)
    wrong = client(address, tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, **once)
    for refused in (without, wrong):
        assert refused.returncode != 0 and CONNECTED not in refused.stdout, refused.stdout
        assert "InvalidAuthToken: Authentication token is missing or incorrect" in refused.stderr, refused.stderr[-2000:]

    admitted = client(address, tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(auth_token_file(cluster)))
    assert admitted.returncode == 0, admitted.stderr[-2000:]
    assert f"{CONNECTED} 42" in admitted.stdout


def test_the_token_file_is_the_owner_s_alone_and_every_port_is_loopback(private_head):
    """Tried: the token file's permission bits (0600: no group or other access) and, over every
    process of the head, each socket listening for connections: all on 127.0.0.1 (IPv4 or mapped)."""
    cluster, address = private_head
    token = auth_token_file(cluster)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.stat().st_uid == os.getuid()
    assert len(token.read_text()) >= 64  # 32 random bytes, hex

    head = psutil.Process(json.loads((token.parent / "ray-head.json").read_text())["pid"])
    pids = {head.pid, *(child.pid for child in head.children(recursive=True))}
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids}
    assert ("::ffff:127.0.0.1", cluster.head_port) in listening or ("127.0.0.1", cluster.head_port) in listening, listening
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip, _ in listening), listening


def test_a_run_attaches_to_the_recorded_head_only_while_it_runs(private_head, tmp_path, monkeypatch):
    """A run finds the head recorded under cluster.home without asking `ray status`: its process lives
    and its port listens. Tried: the live head (found); a record whose process has exited (a head
    killed without `trellis cluster down`), and one whose process lives but whose port nobody listens
    on; neither is taken for a head: with start_if_missing off, each is refused with ClusterError."""
    cluster, address = private_head
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # an address given outright is taken as it is
    assert resolve_address(cluster, start_if_missing=False) == address

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    for pid, port in ((ended.pid, cluster.head_port), (os.getpid(), _free_port())):
        home = tmp_path / f"home-{pid}"
        home.mkdir()
        (home / "ray-head.json").write_text(json.dumps({"address": f"127.0.0.1:{port}", "pid": pid}))
        with pytest.raises(ClusterError, match="No Ray cluster is running"):
            resolve_address(ClusterConfig(home=str(home), head_port=port), start_if_missing=False)
