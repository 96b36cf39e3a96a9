"""Two nodes of one private cluster on this machine: a placement group spreads actors over both, and
they form a torch.distributed (gloo) group across the nodes, as trellis's trainer ranks do."""

from __future__ import annotations

import socket
import time

import pytest

ray = pytest.importorskip("ray")

from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from two_nodes import alive_nodes, second_node

NAMESPACE = "trellis-test-two-nodes"


@ray.remote(num_cpus=0)
class Member:
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def group_address(self) -> tuple[str, int]:
        """Where the group meets: this (rank 0's) node, on a free port."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            return host, probe.getsockname()[1]

    def all_reduce(self, host: str, port: int, rank: int, world_size: int, value: float) -> float:
        import datetime

        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=30),
        )
        try:
            tensor = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(tensor)
            return float(tensor.item())
        finally:
            dist.destroy_process_group()


def test_actors_spread_over_two_nodes_form_a_gloo_group(ray_cluster, tmp_path):
    head_id = ray.get_runtime_context().get_node_id()
    assert [n["NodeID"] for n in alive_nodes()] == [head_id]

    started = time.monotonic()
    with second_node(ray_cluster, tmp_path) as node2:
        up_s = time.monotonic() - started
        assert node2 != head_id and len(alive_nodes()) == 2
        assert {n["NodeManagerAddress"] for n in alive_nodes()} == {"127.0.0.1"}  # loopback only

        group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
        members = []
        try:
            ray.get(group.ready(), timeout=60)
            members = [
                Member.options(
                    name=f"member-{rank}", namespace=NAMESPACE, lifetime="detached",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
                ).remote()
                for rank in range(2)
            ]
            nodes = ray.get([m.node_id.remote() for m in members], timeout=60)
            assert set(nodes) == {head_id, node2}, nodes
            bundle_nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
            assert nodes == [bundle_nodes[0], bundle_nodes[1]]

            host, port = ray.get(members[0].group_address.remote(), timeout=30)
            sums = ray.get([m.all_reduce.remote(host, port, rank, 2, rank + 1.0) for rank, m in enumerate(members)], timeout=60)
            assert sums == [3.0, 3.0]
        finally:
            for member in members:
                ray.kill(member)
            remove_placement_group(group)
        stopping = time.monotonic()

    down_s = time.monotonic() - stopping
    assert [n["NodeID"] for n in alive_nodes()] == [head_id]
    assert node2 in {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
    print(f"second node: up in {up_s:.1f} s, gone in {down_s:.1f} s")
