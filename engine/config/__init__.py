"""The run configuration: one frozen pydantic model (``TrellisConfig``) and its sections, loadable from
YAML with errors a person can act on (``engine.config.loading``)."""

from trellis.engine.config.cluster import ClusterConfig
from trellis.engine.config.lora import LoraConfig
from trellis.engine.config.attest import AttestConfig
from trellis.engine.config.guard import GuardConfig
from trellis.engine.config.dynamic_sampling import DynamicSamplingConfig
from trellis.engine.config.dataset import DatasetConfig
from trellis.engine.config.sections import (
    AdvantageConfig,
    AgentConfig,
    LoadCheckpointConfig,
    LossConfig,
    OptimConfig,
    ReplayBufferConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    RolloutISConfig,
    TaskConfig,
    TrainWorkerConfig,
)
from trellis.engine.config.trellis import TrellisConfig

__all__ = [
    "AdvantageConfig",
    "AgentConfig",
    "AttestConfig",
    "ClusterConfig",
    "DatasetConfig",
    "DynamicSamplingConfig",
    "GuardConfig",
    "LoadCheckpointConfig",
    "LoraConfig",
    "LossConfig",
    "OptimConfig",
    "ReplayBufferConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutISConfig",
    "TaskConfig",
    "TrainWorkerConfig",
    "TrellisConfig",
]
