"""The run configuration: one frozen pydantic model, loadable from YAML.

Field names follow XTuner v1's ``BaseRLTrainerConfig`` where a field exists there (``load_from``,
``train_batch_size``, ``sync_weights_interval``, ...), so XTuner users feel at home; the generated
configuration reference (docs/configuration.md) says where a meaning differs. Every knob is a field; nothing is read from
environment variables. Cross-field rules raise ``ValueError`` with a message that says what to change.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trellis.engine.config.attest import AttestConfig
from trellis.engine.config.base import Frozen, Location, StorageOptions
from trellis.engine.config.cluster import ClusterConfig
from trellis.engine.config.guard import GuardConfig
from trellis.engine.config.lora import LoraConfig
from trellis.engine.config.rules import RULES
from trellis.engine.config.trace import TraceConfig
from trellis.engine.config.trackers import TrackerNames, TrackersConfig
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
    TaskConfig,
    TrainWorkerConfig,
)


class TrellisConfig(Frozen):
    """Everything one RL run needs."""

    load_from: Location = Field(description="HF checkpoint folder (or fsspec URI) of the policy to train.")
    tokenizer_path: Location | None = Field(None, description="Defaults to load_from.")
    train_dataset: DatasetConfig | None = Field(None, description="The prompts of a one-task run; several tasks go in `tasks`.")
    eval_dataset: DatasetConfig | None = Field(None, description="Held-out prompts for evaluation (enable_evaluate, enable_initial_evaluate).")
    tasks: list[TaskConfig] = Field(
        default_factory=list, description="A multi-task run: each task with its dataset, agent loop, reward and weight."
    )
    task_mix: Literal["exact", "random"] = Field(
        "exact", description="How a multi-task run splits its draws by weight: exact (as XTuner: every batch split by the "
        "weights, the remainder to the tasks furthest behind their share so far) or random (each group's task drawn "
        "with probability weight / total).",
    )
    work_dir: Location = Field("work_dirs", validate_default=True, description="Any fsspec URI: trajectories, checkpoints, logs go here.")
    experiment_name: str = Field(
        "run",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The run's name: outputs go to {work_dir}/{experiment_name}/, its workers to the Ray namespace trellis-{experiment_name}.",
    )
    storage_options: StorageOptions = Field(
        default_factory=dict,
        repr=False,
        description="fsspec options for work_dir. Credentials are better left to the environment (AWS_ACCESS_KEY_ID...); "
        "secret-looking entries are masked wherever the config is written out.",
    )

    train_batch_size: int = Field(
        16, gt=0, description="Prompts (groups) per training step. XTuner's counts rollout samples: its 128 is 16 here with prompt_repeat_k: 8."
    )
    prompt_repeat_k: int = Field(8, gt=0, description="Samples per prompt: the GRPO group size.")
    total_train_steps: int | None = Field(None, description="Steps to train; this or total_epochs is required.")
    total_epochs: int | None = Field(None, description="Epochs to train: dataset_size // train_batch_size * total_epochs steps.")

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train_worker: TrainWorkerConfig = Field(default_factory=TrainWorkerConfig)
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters on a frozen base instead of every weight (null: full fine-tuning)."
    )

    sync_weights_interval: int = Field(1, description="Steps between weight syncs to the rollout workers; saves and evaluations fall on sync steps.")
    attest: AttestConfig = Field(default_factory=AttestConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    check_weights_interval: int = Field(
        0, ge=0,
        description="Every N-th weight sync, check that the rollout serves the trainer's weights (a few sums per "
        "tensor on each side, compared; the step fails on a mismatch). 0 (default): never, because vLLM cannot "
        "export the weights it serves. On the bundled tiny model on CPU a check takes ~40-75 ms, about a sync's "
        "time or a tenth of a step; on a sharded model it also gathers the full weights once more.",
    )
    enable_evaluate: bool = Field(
        False, description="Needs eval_dataset. XTuner's defaults to true; off here since most datasets come without a held-out split."
    )
    enable_initial_evaluate: bool = Field(False, description="Evaluate the initial policy before the first step (step 0).")
    eval_correct_threshold: float = Field(
        0.5, description="An evaluation sample counts as correct (eval/accuracy, eval/pass@k) when its reward is above this."
    )
    eval_metric: str | None = Field(
        None, description="Your own evaluation metric, 'module:function' (shipped like reward code): called with the "
        "evaluation's groups (lists of sample dicts as a reward sees them, plus 'reward'), it returns {name: number}; "
        "each is logged as eval/<name> beside accuracy and pass@k.",
    )
    evaluate_step: int = Field(1, description="Steps between evaluations; a multiple of sync_weights_interval.")
    checkpoint_interval: int | None = Field(-1, description="Steps between checkpoints (and at the last step); -1 or null: none.")
    checkpoint_maxkeep: int | None = Field(-1, description="Complete checkpoints kept; -1 or null: all. The newest is never removed.")
    hf_interval: int | None = Field(-1, description="Steps between HF exports (and at the last step); -1 or null: none.")
    hf_max_keep: int | None = Field(-1, description="HF exports kept; -1 or null: all.")
    skip_checkpoint_validation: bool = Field(
        False, description="Several trainer ranks: skip DCP's check that the saved shards tile every tensor exactly "
        "(XTuner's key). With torch 2.11-2.13 the check costs ~12 ms at 8 ranks, 80 ms at 64 and 0.6 s at 512 per "
        "save of 1,000 tensors, so it stays on unless a save's planning time says otherwise.",
    )
    checkpoint_no_save_optimizer: bool = Field(
        False, description="Leave AdamW state out of checkpoints; resuming then needs load_checkpoint_cfg.load_optimizer_states: false."
    )
    checkpoint_no_save_replay_buffer: bool = Field(
        False,
        description="disaggregated: keep only the buffered prompts in checkpoints (not their generations), "
        "which a resume generates again.",
    )
    auto_resume: bool = Field(False, description="Continue from the latest complete checkpoint of this run, if any.")
    load_checkpoint_cfg: LoadCheckpointConfig = Field(default_factory=LoadCheckpointConfig)

    seed: int = Field(42, description="Seeds prompt order, sampling and initialisation; a resumed run continues its RNG streams.")
    deterministic: bool = Field(False, description="Deterministic kernels and no micro-batch shuffle.")
    debug_rollout: bool = Field(False, description="Start no trainer: generate and score batches with the initial policy into debug_rollout_dir.")
    debug_train: bool = Field(False, description="Start no rollout worker: train on the batches stored under debug_rollout_dir, one per step.")
    debug_rollout_dir: Location | None = Field(None, description="Where debug_rollout writes and debug_train reads; any run folder works.")
    exp_tracker: TrackerNames = Field(
        ["tensorboard"], description="Where metrics go besides metrics.jsonl (always written): one name or a list of "
        "tensorboard, wandb, mlflow (their settings under trackers:); jsonl alone: metrics.jsonl only.",
    )
    trackers: TrackersConfig = Field(default_factory=TrackersConfig)
    trace: TraceConfig = Field(default_factory=TraceConfig)
    log_dir: Location | None = Field(None, description="Where the run's text log (run.log) goes; default {run}/logs.")
    artifact_links: Literal["uri", "console", "presigned"] = Field(
        "uri",
        description="How Prefect artifacts link s3:// partitions and checkpoints: as URIs, as AWS console links, or as "
        "presigned HTTPS links (valid for artifact_link_expiry_s).",
    )
    artifact_link_expiry_s: int = Field(7 * 24 * 3600, gt=0, le=7 * 24 * 3600, description="How long presigned artifact links stay valid.")

    trainer: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="colocated: every step generates, then trains, on shared devices. disaggregated: a producer on "
        "the rollout workers keeps generating into a replay buffer while the trainer trains (XTuner's "
        "RLDisaggregatedTrainer).",
    )
    train_resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    rollout_resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    replay_buffer: ReplayBufferConfig = Field(default_factory=ReplayBufferConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _check_rules(self) -> TrellisConfig:
        problems = [problem for rule in RULES for problem in rule(self)]
        if problems:
            raise ValueError("\n".join(problems))  # the loader lists each line as one problem
        return self

    @property
    def train_datasets(self) -> list[DatasetConfig]:
        if self.tasks:
            return [task.train_dataset for task in self.tasks]
        return [self.train_dataset] if self.train_dataset is not None else []

    @property
    def eval_datasets(self) -> list[DatasetConfig]:
        found = [task.eval_dataset for task in self.tasks] if self.tasks else [self.eval_dataset]
        return [dataset for dataset in found if dataset is not None]

    @property
    def max_prompt_length(self) -> int:
        return max((dataset.max_prompt_length for dataset in self.train_datasets), default=0)

    @property
    def agents(self) -> list[AgentConfig]:
        """Every agent loop of the run (the run's, and its tasks' own)."""
        return [self.agent, *(task.agent for task in self.tasks if task.agent is not None)]

    @property
    def rewards(self) -> list[RewardConfig]:
        """The reward configs the run scores with (the run's own is unused where every task names one)."""
        found = [self.reward, *(task.reward for task in self.tasks if task.reward is not None)]
        return [reward for reward in found if reward.function is not None]

    @property
    def captures_routing(self) -> bool:
        """Whether rollouts record the experts of each response token (MoE policies)."""
        return self.rollout.return_routed_experts or self.train_worker.routing_replay == "r3"

    @property
    def disaggregated(self) -> bool:
        return self.trainer == "disaggregated"

    @property
    def over_samples(self) -> bool:
        """A colocated run that launches more groups than it trains (XTuner's over_sample_threshold)."""
        return not self.disaggregated and self.replay_buffer.over_sample_threshold > 0

    @property
    def keeps_replay_buffer(self) -> bool:
        return self.disaggregated or self.over_samples

    @property
    def stale_after(self) -> int:
        """A sample this stale (see ReplayBufferConfig) is too old to train."""
        return (self.replay_buffer.max_staleness + 1) * self.sync_weights_interval

    @property
    def tokenizer_source(self) -> str:
        return self.tokenizer_path or self.load_from

    @property
    def ray_namespace(self) -> str:
        return self.cluster.namespace or f"trellis-{self.experiment_name}"

    @property
    def run_uri(self) -> str:
        return f"{self.work_dir.rstrip('/')}/{self.experiment_name}"

    def trajectory_root(self, split: str) -> str:
        """Where a split's trajectories go: ``debug_rollout`` keeps its train batches in ``debug_rollout_dir``."""
        if self.debug_rollout and split == "train" and self.debug_rollout_dir is not None:
            return self.debug_rollout_dir
        return self.run_uri

    @property
    def log_uri(self) -> str:
        return (self.log_dir or f"{self.run_uri}/logs").rstrip("/")

    @property
    def checkpoint_uri(self) -> str:
        return f"{self.run_uri}/checkpoints"

    @property
    def hf_uri(self) -> str:
        return f"{self.run_uri}/hf"
