"""The run configuration: one frozen pydantic model, loadable from YAML.

Field names follow XTuner v1's ``BaseRLTrainerConfig`` where a field exists there (``load_from``,
``train_batch_size``, ``sync_weights_interval``, ...), so XTuner users feel at home. Every knob is a
field; nothing is read from environment variables. Cross-field rules raise ``ValueError`` with a
message that says what to change.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, model_validator

from engine.secrets import REDACTED, redact_mapping


def _no_masked_secrets(options: dict[str, Any]) -> dict[str, Any]:
    masked = [name for name, value in options.items() if value == REDACTED]
    if masked:
        raise ValueError(
            f"storage_options {masked} hold the mask {REDACTED!r}, not credentials: configs written out by "
            "trellis (Prefect parameters, checkpoints) never carry secrets. Put the credentials in the "
            "workers' environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or in the YAML file."
        )
    return options


# JSON dumps of a config reach Prefect's API (flow parameters), checkpoints and logs: never credentials.
StorageOptions = Annotated[
    dict[str, Any], AfterValidator(_no_masked_secrets), PlainSerializer(redact_mapping, when_used="json")
]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatasetConfig(_Frozen):
    """A prompt dataset: Parquet or JSONL, local or any fsspec URI."""

    path: str = Field(description="File or folder (Parquet / JSONL), local path or fsspec URI.")
    format: Literal["auto", "parquet", "jsonl"] = "auto"
    prompt_key: str = "prompt"
    label_key: str = "label"
    data_source_key: str = "data_source"
    task_name_key: str = "task_name"
    max_prompt_length: int = Field(
        1024, gt=0, description="Prompts longer than this many tokens (after the chat template) are skipped and counted."
    )
    storage_options: StorageOptions = Field(default_factory=dict, repr=False, description="Passed to fsspec (e.g. S3 endpoint).")
    limit: int | None = Field(None, gt=0, description="Read only the first N usable rows (evaluation sets).")


class RolloutConfig(_Frozen):
    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="transformers runs anywhere (CPU default); vllm needs an accelerator."
    )
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_new_tokens: int = Field(8, gt=0)
    stop_token_ids: tuple[int, ...] = Field((), description="Extra stop tokens; the tokenizer's eos always stops.")
    eval_temperature: float = Field(0.0, ge=0.0, description="Evaluation samples greedily by default.")
    eval_samples_per_prompt: int = Field(1, gt=0, description="k for the evaluator's pass@k.")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="vLLM only.")
    sleep_level: Literal[1, 2] = Field(1, description="vLLM only: level of sleep while the trainer trains.")
    runtime_env: dict[str, Any] | None = Field(
        None,
        description="Ray runtime_env of the rollout worker, e.g. {env_vars: {PYTHONPATH: '/opt/vllm-site:${PYTHONPATH}'}} "
        "where vLLM lives outside the cluster's environment.",
    )


class RewardConfig(_Frozen):
    function: str = Field(
        "engine.tiny.reverse_task:score",
        description="`module:function` taking the sample dict and returning a float or a dict with 'score'.",
    )
    by_data_source: dict[str, str] = Field(
        default_factory=dict, description="Per-data_source overrides of `function`."
    )
    timeout_s: float = Field(10.0, gt=0.0, description="A call past this marks its sample FAILED.")
    num_workers: int = Field(1, ge=1, description="Processes scoring in parallel (isolated from the trainer).")


class AdvantageConfig(_Frozen):
    estimator: Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "pass_at_k"] = "grpo"
    eps: float = Field(1e-4, gt=0.0, description="Added to the group std (GRPO) to avoid dividing by zero.")
    pass_at_k: int = Field(4, gt=0, description="k of the pass@k estimator.")
    correct_threshold: float = Field(0.5, description="pass@k: a reward above this counts as correct.")


class RolloutISConfig(_Frozen):
    """Importance-sampling correction for the train/rollout policy mismatch."""

    level: Literal["none", "token", "sequence"] = "none"
    mode: Literal["truncate", "mask"] = "truncate"
    upper: float = Field(2.0, gt=1.0)
    lower: float | None = Field(None, gt=0.0, lt=1.0, description="mask mode only; default 1/upper.")


class LossConfig(_Frozen):
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    clip_eps_high: float = Field(0.2, gt=0.0, description="Clip-higher (DAPO) when larger than clip_eps_low.")
    dual_clip_c: float | None = Field(None, gt=1.0, description="Dual-clip bound for negative advantages.")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to the initial (reference) model; 0 loads none.")
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    rollout_is: RolloutISConfig = Field(default_factory=RolloutISConfig)


class OptimConfig(_Frozen):
    lr: float = Field(3e-4, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="Counted in optimizer steps.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)


class TrainWorkerConfig(_Frozen):
    optimizer_steps: int = Field(1, gt=0, description="Mini-batches (optimizer steps) per rollout batch.")
    pack_max_length: int = Field(4096, gt=0, description="Token budget of one micro-batch.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU.")
    gradient_checkpointing: bool = False
    layout: Literal["auto", "packed", "padded", "shared_prefix"] = Field(
        "auto",
        description="How a micro-batch meets the model. packed: sequences end to end in one row with "
        "attention kept inside each (varlen flash attention on GPU, no pad tokens computed). padded: "
        "right-padded rows. shared_prefix: each distinct prompt runs once and its KV cache serves its group's "
        "samples (exact; best on CPU, where GRPO's repeated prompts dominate). auto: packed on GPU, "
        "shared_prefix on CPU (padded with gradient checkpointing, which drops the KV cache).",
    )
    logprob_chunk_tokens: int = Field(
        2048,
        gt=0,
        description="Labelled positions sent through the output layer at once; bounds the float32 logits "
        "held at any time to this many rows of the vocabulary.",
    )
    fsdp: bool = Field(
        False,
        description="Wrap the policy with FSDP2 (fully_shard): fp32 master weights and AdamW states, bf16 compute "
        "from a mixed-precision policy, shards over the trainer's GPUs. Off: one GPU under bf16 autocast, which "
        "measured 1.6x faster than FSDP2 at world size 1 on an H200 (bench/gpu/train_mfu.py).",
    )
    compile: bool = Field(
        False,
        description="torch.compile the decoder (fuses the norms, rotary and activations between the matmuls; "
        "1.37x training tokens/s for a 0.5B model on an H200). The first steps pay the compile.",
    )
    compile_scope: Literal["layers", "decoder"] = Field(
        "layers",
        description="With compile: each decoder layer on its own (identical layers share one graph; ~30 s of compile "
        "for a 0.5B model on an H200), or the whole decoder as one graph (fewer host calls per step: 1.17x the "
        "tokens/s of layers there, but ~6 min of compile).",
    )
    cuda_graphs: bool = Field(
        False,
        description="With compile and packed rows on a GPU: replay the compiled decoder as CUDA graphs "
        "(torch.compile's reduce-overhead mode), so the host no longer launches each kernel. Every packed row "
        "is filled to pack_max_length so that one graph serves every micro-batch; the fill is computed. The "
        "graphs keep their memory while the trainer is offloaded, so this suits a trainer that owns its GPU.",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    offload_when_idle: bool = Field(
        True,
        description="Colocated: move weights and AdamW state to CPU while the rollout runs (as XTuner does). "
        "False keeps them on the GPU when it has room for both, which saves two host transfers per step.",
    )

    @model_validator(mode="after")
    def _check_layout(self) -> TrainWorkerConfig:
        if self.layout == "shared_prefix" and self.gradient_checkpointing:
            raise ValueError(
                "train_worker.layout: shared_prefix needs the prompts' KV cache, which gradient checkpointing "
                "drops; use layout: packed or padded, or turn gradient_checkpointing off."
            )
        if self.cuda_graphs:
            conflicts = {
                "compile is off (the graphs are compiled code)": not self.compile,
                f"layout is {self.layout} (rows of one shape need packed)": self.layout not in ("auto", "packed"),
                "fsdp is on": self.fsdp,
                "gradient_checkpointing is on": self.gradient_checkpointing,
            }
            found = [reason for reason, conflict in conflicts.items() if conflict]
            if found:
                raise ValueError(f"train_worker.cuda_graphs: {'; '.join(found)}. CUDA graphs run compiled, packed rows "
                                 "without fsdp or gradient checkpointing.")
        return self


class ClusterConfig(_Frozen):
    """Where the workers run. With nothing set, trellis attaches to the head that `trellis cluster up`
    started, or starts one (it stays up for later runs; `trellis cluster down` stops it)."""

    address: str | None = Field(None, description="A running cluster (host:port); RAY_ADDRESS also works.")
    head_port: int = Field(6379, gt=0, lt=65536, description="Port of a local head that trellis starts.")
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


class LoadCheckpointConfig(_Frozen):
    """An explicit checkpoint to start from (``auto_resume`` finds the latest one by itself)."""

    checkpoint_path: str | None = Field(None, description="A checkpoints/step-NNNNNN folder (any fsspec URI).")
    load_optimizer_states: bool = Field(True, description="False: fresh AdamW moments (e.g. after changing the lr).")
    load_dataset: bool = Field(True, description="False: restart the prompt order instead of continuing it.")


def validate_intervals(
    sync_weights_interval: int,
    checkpoint_interval: int | None,
    hf_interval: int | None,
    evaluate_step: int,
    enable_evaluate: bool,
) -> None:
    """Saves and evaluations run on weight-sync steps only, so their intervals must be multiples of it."""
    if sync_weights_interval <= 0:
        raise ValueError(f"sync_weights_interval must be positive, got {sync_weights_interval}.")
    for name, interval in (("checkpoint_interval", checkpoint_interval), ("hf_interval", hf_interval)):
        if interval is None or interval == -1:
            continue
        if interval <= 0:
            raise ValueError(f"{name} must be positive, or -1 / null to disable it; got {interval}.")
        if interval % sync_weights_interval:
            raise ValueError(
                f"{name}={interval} must be a multiple of sync_weights_interval={sync_weights_interval}, "
                "because checkpoints and HF exports are written on weight-sync steps only."
            )
    if enable_evaluate:
        if evaluate_step <= 0:
            raise ValueError(f"evaluate_step must be positive when evaluation is enabled, got {evaluate_step}.")
        if evaluate_step % sync_weights_interval:
            raise ValueError(
                f"evaluate_step={evaluate_step} must be a multiple of sync_weights_interval="
                f"{sync_weights_interval}, because evaluation runs on weight-sync steps only."
            )


class TrellisConfig(_Frozen):
    """Everything one RL run needs."""

    load_from: str = Field(description="HF checkpoint folder (or fsspec URI) of the policy to train.")
    tokenizer_path: str | None = Field(None, description="Defaults to load_from.")
    train_dataset: DatasetConfig
    eval_dataset: DatasetConfig | None = None
    work_dir: str = Field("work_dirs", description="Any fsspec URI: trajectories, checkpoints, logs go here.")
    experiment_name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$")
    storage_options: StorageOptions = Field(
        default_factory=dict,
        repr=False,
        description="fsspec options for work_dir. Credentials are better left to the environment (AWS_ACCESS_KEY_ID...); "
        "secret-looking entries are masked wherever the config is written out.",
    )

    train_batch_size: int = Field(16, gt=0, description="Prompts (groups) per training step.")
    prompt_repeat_k: int = Field(8, gt=0, description="Samples per prompt: the GRPO group size.")
    total_train_steps: int | None = None
    total_epochs: int | None = None

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train_worker: TrainWorkerConfig = Field(default_factory=TrainWorkerConfig)

    sync_weights_interval: int = 1
    enable_evaluate: bool = Field(False, description="Needs eval_dataset.")
    enable_initial_evaluate: bool = False
    evaluate_step: int = 1
    checkpoint_interval: int | None = -1
    checkpoint_maxkeep: int | None = -1
    hf_interval: int | None = -1
    hf_max_keep: int | None = -1
    checkpoint_no_save_optimizer: bool = False
    checkpoint_no_save_replay_buffer: bool = False
    auto_resume: bool = Field(False, description="Continue from the latest complete checkpoint of this run, if any.")
    load_checkpoint_cfg: LoadCheckpointConfig = Field(default_factory=LoadCheckpointConfig)

    seed: int = 42
    deterministic: bool = Field(False, description="Deterministic kernels and no micro-batch shuffle.")
    debug_rollout: bool = False
    debug_train: bool = False
    debug_rollout_dir: str | None = None
    exp_tracker: Literal["tensorboard", "jsonl"] = "tensorboard"
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _check_rules(self) -> TrellisConfig:
        if self.debug_rollout and self.debug_train:
            raise ValueError("debug_rollout and debug_train cannot both be enabled; pick one.")
        if (self.debug_rollout or self.debug_train) and self.debug_rollout_dir is None:
            mode = "debug_rollout" if self.debug_rollout else "debug_train"
            raise ValueError(f"debug_rollout_dir must be set when {mode}=true.")
        if not self.debug_train and self.total_train_steps is None and self.total_epochs is None:
            raise ValueError("Either total_train_steps or total_epochs must be set.")
        if self.total_train_steps is not None and self.total_train_steps <= 0:
            raise ValueError(f"total_train_steps must be positive, got {self.total_train_steps}.")
        if self.total_epochs is not None and self.total_epochs <= 0:
            raise ValueError(f"total_epochs must be positive, got {self.total_epochs}.")
        validate_intervals(
            self.sync_weights_interval,
            self.checkpoint_interval,
            self.hf_interval,
            self.evaluate_step,
            self.enable_evaluate,
        )
        for name in ("checkpoint_maxkeep", "hf_max_keep"):
            keep = getattr(self, name)
            if keep is not None and keep != -1 and keep <= 0:
                raise ValueError(f"{name} must be positive, or -1 / null to keep all; got {keep}.")
        if (self.enable_evaluate or self.enable_initial_evaluate) and self.eval_dataset is None:
            raise ValueError("Evaluation is enabled but eval_dataset is not set; set one or enable_evaluate=false.")
        if self.loss.clip_eps_high < self.loss.clip_eps_low:
            raise ValueError(
                f"loss.clip_eps_high={self.loss.clip_eps_high} is below loss.clip_eps_low="
                f"{self.loss.clip_eps_low}; clip-higher only widens the upper bound."
            )
        if self.advantage.estimator in ("grpo", "rloo", "pass_at_k") and self.prompt_repeat_k < 2:
            raise ValueError(
                f"advantage.estimator={self.advantage.estimator!r} compares samples of one prompt: "
                f"prompt_repeat_k must be at least 2, got {self.prompt_repeat_k}."
            )
        if self.advantage.estimator == "pass_at_k" and self.advantage.pass_at_k > self.prompt_repeat_k:
            raise ValueError(
                f"advantage.pass_at_k={self.advantage.pass_at_k} exceeds prompt_repeat_k={self.prompt_repeat_k}."
            )
        longest = self.train_dataset.max_prompt_length + self.rollout.max_new_tokens - 1
        if longest > self.train_worker.pack_max_length:
            raise ValueError(
                f"train_worker.pack_max_length={self.train_worker.pack_max_length} cannot hold a sample of "
                f"train_dataset.max_prompt_length + rollout.max_new_tokens - 1 = {longest} tokens; raise it or "
                "lower those two."
            )
        if self.train_batch_size * self.prompt_repeat_k < self.train_worker.optimizer_steps:
            raise ValueError(
                f"train_worker.optimizer_steps={self.train_worker.optimizer_steps} exceeds the "
                f"{self.train_batch_size * self.prompt_repeat_k} samples of a batch."
            )
        return self

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
    def checkpoint_uri(self) -> str:
        return f"{self.run_uri}/checkpoints"

    @property
    def hf_uri(self) -> str:
        return f"{self.run_uri}/hf"

    def checkpoint_due(self, step: int, total_steps: int) -> bool:
        """Checkpoint on the interval, and at the last step when it syncs weights (the run can then be extended)."""
        if self.checkpoint_interval in (None, -1) or self.debug_rollout:
            return False
        last_synced = step == total_steps and step % self.sync_weights_interval == 0
        return step % self.checkpoint_interval == 0 or last_synced

    def hf_due(self, step: int, total_steps: int) -> bool:
        if self.hf_interval in (None, -1) or self.debug_rollout:
            return False
        return step % self.hf_interval == 0 or step == total_steps
