"""Where a run's workers live: the Ray cluster, placement on GPUs, bounds on waits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from trellis.engine.config.base import Frozen, Location, checked_runtime_env


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
    torch_threads: int | None = Field(
        None, gt=0, description="torch threads per worker; default: TRELLIS_TORCH_THREADS where the worker runs (a machine "
        "whose cores several runs share at once), else all cores.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="How Ray places the bundles of a placement group (one per trainer rank or rollout worker): "
        "PACK fills one node first; SPREAD puts them on as many nodes as it can.",
    )
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
        1, ge=0, description="Prefect retries of a failed rl_run (one attempt of a run); each resumes from the last checkpoint."
    )
    code_dir: Location | None = Field(
        None,
        description="The folder whose files the workers get as their working directory when a function the config "
        "names lives in it; default: the directory the run is launched from.",
    )
    code_excludes: tuple[str, ...] = Field(
        (), description="Gitignore patterns of files under code_dir that are not shipped (beside weights, data and outputs)."
    )
    runtime_env: dict[str, Any] | None = Field(
        None,
        description="A Ray runtime_env merged into every worker's, e.g. {pip: [sympy==1.13]} or {env_vars: {...}}; "
        "trellis sets working_dir itself, and secrets go in the launching shell, never here (Ray shows runtime_envs).",
    )
    forward_env: tuple[str, ...] = Field(
        (),
        description="Names of environment variables of the launching shell that follow the run to its workers, "
        "beside the object-storage ones (AWS_ACCESS_KEY_ID, ...) that always do; e.g. [HF_TOKEN].",
    )
    overlap_next_rollout: bool | None = Field(
        None,
        description="Launch the next step's rollout as soon as this step's weights are synced (and evaluated), so "
        "that the step's records and the next flow run's start overlap generation; same prompts and weights. False: "
        "each step starts after the previous one is fully recorded. Default: on when the rollout worker generates "
        "on a GPU, off on CPU, where the records' work would compete with generation for the cores.",
    )

    @field_validator("runtime_env")
    @classmethod
    def _check_runtime_env(cls, runtime_env: dict[str, Any] | None) -> dict[str, Any] | None:
        return checked_runtime_env(runtime_env, "cluster.runtime_env")

    def overlaps_next_rollout(self, rollout_on_gpu: bool) -> bool:
        return rollout_on_gpu if self.overlap_next_rollout is None else self.overlap_next_rollout


