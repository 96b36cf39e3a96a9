"""Trainer weights to the rollout workers on other devices, one torch.distributed broadcast per
bucket: NCCL between GPUs (other cards or other nodes), gloo where a side runs on CPU.

The trainer's rank 0 and the M rollout workers form a group of their own (rank 0, the trainer, hosts
its TCP store; the workers are ranks 1..M) rather than joining the default group, which vLLM and
FSDP own in their processes. Before
each broadcast the rollout worker learns the bucket layouts (names, shapes, offsets) and allocates
the buffers; only the layouts travel through Ray, the weights go straight from device to device.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from trellis.engine.compat import close_group, nccl_group
from trellis.engine.weights.buckets import Bucket, BucketLayout

SENDER, RECEIVER = 0, 1  # receivers are ranks 1 .. size - 1


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    key: str  # names one set of trainer and rollout processes; a restarted worker makes a new one
    nccl: bool
    size: int = 2  # the sender and the receivers


def free_address(host: str, key: str, *, nccl: bool, size: int = 2) -> GroupAddress:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return GroupAddress(host, port, key, nccl, size)


class WeightGroup:
    """This process's place in a weight group; building it waits until every member builds its own."""

    def __init__(self, address: GroupAddress, rank: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.address = address
        size = address.size
        store = dist.TCPStore(address.host, address.port, size, is_master=rank == SENDER, timeout=timeout)
        self._store = dist.PrefixStore(address.key, store)
        if address.nccl:
            self._group = nccl_group(self._store, rank, size, timeout)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._group = dist.ProcessGroupGloo(self._store, rank, size, timeout)
            self.device = torch.device("cpu")

    def send(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            self._broadcast(bucket.flat)

    def receive(self, layouts: list[BucketLayout]) -> Mapping[str, torch.Tensor]:
        """The sender's weights, by name, in buffers of this process's device."""
        weights: dict[str, torch.Tensor] = {}
        for layout in layouts:
            bucket = layout.allocate(self.device)
            self._broadcast(bucket.flat)
            weights.update(bucket.tensors())
        return weights

    def close(self) -> None:
        """Drop this end without waiting for the other (which may be gone: a lost rollout worker)."""
        close_group(self._group, nccl=self.address.nccl)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = SENDER
        self._group.broadcast([tensor], options).wait()


def rejoin(current: WeightGroup | None, address: GroupAddress, rank: int, timeout_s: float) -> WeightGroup:
    """The group at ``address``, kept when already joined; a group with another peer is closed first."""
    if current is not None and current.address == address:
        return current
    if current is not None:
        current.close()
    return WeightGroup(address, rank, timeout_s)
