"""How much of a GPU each of a run's workers asks Ray for."""

from __future__ import annotations

from engine.config import TrellisConfig
from engine.run.plan import Role, roles_for


class GpuPlacementError(RuntimeError):
    """The run needs GPUs that the cluster does not offer."""


def gpu_requests(config: TrellisConfig, cluster_gpus: float) -> dict[Role, float]:
    """The GPU fraction each role asks Ray for. On a cluster with GPUs, device ``auto`` means the
    trainer takes one, and the rollout follows it (vLLM always needs one); by default the GPU workers
    split one GPU, colocated, as XTuner's colocated trainer does."""
    roles = roles_for(config)
    device = config.train_worker.device
    trainer_gpu = device == "cuda" or (device == "auto" and cluster_gpus > 0)
    wants: list[Role] = []
    if "trainer" in roles and trainer_gpu:
        wants.append("trainer")
    if "rollout" in roles and (config.rollout.backend == "vllm" or trainer_gpu):
        wants.append("rollout")
    if wants and cluster_gpus <= 0:
        raise GpuPlacementError(
            f"The {' and '.join(wants)} worker(s) need a GPU (train_worker.device={device}, "
            f"rollout.backend={config.rollout.backend}), but the Ray cluster offers none. Start the cluster on a "
            "GPU machine, or use train_worker.device: cpu with rollout.backend: transformers."
        )
    share = config.cluster.gpu_share or (1.0 / len(wants) if wants else 0.0)
    return {role: share for role in wants}
