"""Where a run's workers live: the Ray cluster, placement on GPUs, bounds on waits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config.base import Frozen


class ClusterConfig(Frozen):
    """Where the workers run. With nothing set, trellis attaches to the head that `trellis cluster up`
    started, or starts one (it stays up for later runs; `trellis cluster down` stops it)."""

    address: str | None = Field(None, description="A running cluster (host:port); RAY_ADDRESS also works.")
    head_port: int = Field(6379, gt=0, lt=65536, description="Port of a local head that trellis starts.")
    home: str = Field(
        "~/.trellis",
        description="Where trellis records the local head it started (ray-head.json), so that later runs attach to it.",
    )
    num_cpus: int | None = Field(None, gt=0, description="CPUs a local head offers; default: all.")
    namespace: str | None = Field(None, description="Ray namespace of the run's named actors; default trellis-{experiment_name}.")
    ray_get_timeout_s: float = Field(600.0, gt=0.0, description="Bound on every wait for a worker.")
    gpu_share: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Fraction of a GPU that each GPU worker (trainer, rollout) asks Ray for; default: the run's GPU "
        "workers split one GPU (colocated, weights synced through CUDA IPC).",
    )
    torch_threads: int | None = Field(None, gt=0, description="torch threads per worker; default: all cores.")
    weight_sync: Literal["auto", "broadcast", "object_store"] = Field(
        "auto",
        description="How weights reach a rollout worker that is not on the trainer's GPU. auto: an NCCL broadcast "
        "between two GPUs, Ray's object store on CPU. broadcast: a torch.distributed broadcast in a group of the two "
        "workers (gloo on CPU). object_store: through Ray's object store. Workers sharing a GPU always use CUDA IPC.",
    )
    release_workers_at_end: bool = Field(
        True, description="Kill the run's actors when the run completes; false keeps them for a later flow run to re-attach."
    )
    flow_retries: int = Field(
        1, ge=0, description="Prefect retries of a failed rl_train flow run; each retry resumes from the last checkpoint."
    )
    overlap_next_rollout: bool | None = Field(
        None,
        description="Launch the next step's rollout as soon as this step's weights are synced (and evaluated), so "
        "that the step's records and the next flow run's start overlap generation; same prompts and weights. False: "
        "each step starts after the previous one is fully recorded. Default: on when the rollout worker generates "
        "on a GPU, off on CPU, where the records' work would compete with generation for the cores.",
    )

    def overlaps_next_rollout(self, rollout_on_gpu: bool) -> bool:
        return rollout_on_gpu if self.overlap_next_rollout is None else self.overlap_next_rollout


