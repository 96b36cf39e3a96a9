"""The sections of a run's configuration: data, rollout, reward, advantage, loss, optimizer, training
worker and checkpoint loading. Field names follow XTuner v1's configs where the field exists there."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trellis.engine.config.base import Frozen, Location, checked_runtime_env
from trellis.engine.config.dataset import DatasetConfig
from trellis.engine.config.health import HealthCheckConfig
from trellis.engine.config.rollout_is import RolloutISConfig


class RolloutConfig(Frozen):
    """How responses are generated: the backend and its sampling settings."""

    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="transformers runs anywhere (CPU default); vllm needs an accelerator."
    )
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_new_tokens: int = Field(8, gt=0, description="Token budget of a response (of a whole session in an agent loop).")
    stop_token_ids: tuple[int, ...] = Field((), description="Extra stop tokens; the tokenizer's eos always stops.")
    eval_temperature: float = Field(0.0, ge=0.0, description="Evaluation samples greedily by default.")
    eval_samples_per_prompt: int = Field(1, gt=0, description="k for the evaluator's pass@k.")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="vLLM only.")
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="vLLM only: generate with FP8 weights and activations while the trainer keeps its precision; every "
        "sync re-quantizes the new weights (full syncs only): one scale per weight tensor, per-token activation "
        "scales (vLLM's online fp8). Needs a GPU with FP8 compute (sm89+: Ada, Hopper). The "
        "mismatch it adds shows in the mismatch/ metrics; loss.rollout_is corrects for it.",
    )
    sleep_level: Literal["auto", 0, 1, 2] = Field(
        "auto",
        description="vLLM only: how the colocated engine sleeps while the trainer trains. 1 frees its KV cache and moves "
        "its weights to CPU, 2 drops the weights too; 0 never sleeps (as TRL's colocated default): the engine keeps its "
        "share of the GPU through the fit. auto sleeps as 1 through the first fit, then stays awake at every hand-over "
        "where the GPU's free memory holds what the fits took, with a margin: this saves a sleep and a wake a step.",
    )
    health_check: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    return_routed_experts: bool = Field(
        False,
        description="MoE policies: record the experts the engine routed each response token through (top-k ids of "
        "every MoE layer), for the lake and the router-agreement metrics. train_worker.routing_replay: r3 records "
        "them whatever this says.",
    )
    store_routed_experts: bool = Field(
        True,
        description="Write recorded routings to the lake (routed_experts column, layers x K bytes per response token) "
        "for debug replay, rescoring and counterfactual runs; false keeps them for training only.",
    )
    runtime_env: dict[str, Any] | None = Field(
        None,
        description="Ray runtime_env of the rollout worker, e.g. {env_vars: {PYTHONPATH: '/opt/vllm-site:${PYTHONPATH}'}} "
        "where vLLM lives outside the cluster's environment.",
    )


    @field_validator("runtime_env")
    @classmethod
    def _check_runtime_env(cls, runtime_env: dict[str, Any] | None) -> dict[str, Any] | None:
        return checked_runtime_env(runtime_env, "rollout.runtime_env")


class RewardConfig(Frozen):
    """How a sample is scored: your function, run in worker processes with a time limit."""

    function: str | None = Field(
        None,
        description="Required (null: not set): `module:function` taking the sample dict and returning a float or a dict "
        "with 'score'. There is no default task; built in: trellis.engine.rollout.rewards:exact_match, :math_answer, :math_verify (math-verify).",
    )
    by_data_source: dict[str, str] = Field(
        default_factory=dict, description="Per-data_source overrides of `function`."
    )
    timeout_s: float = Field(10.0, gt=0.0, description="A call past this marks its sample FAILED.")
    num_workers: int = Field(1, ge=1, description="Processes scoring in parallel (isolated from the trainer).")
    overlong_buffer_len: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong punishment: a response longer than (its token budget - this) loses "
        "overlong_penalty_factor x excess / overlong_buffer_len of reward, the whole factor at the budget. 0: off.",
    )
    overlong_penalty_factor: float = Field(1.0, gt=0.0, description="The reward lost at the budget (see overlong_buffer_len).")


class AgentConfig(Frozen):
    """How a sample is made: one response to the prompt (``single_turn``), a session of turns in which
    the model calls tools (``tool``), or your own agent talking to the policy through an OpenAI-compatible
    endpoint (``openai``). A tool session's response holds every turn, token for token as
    generated, with the tools' outputs between them (masked out of the loss); ``rollout.max_new_tokens``
    is the budget of the whole session."""

    loop: Literal["single_turn", "tool", "openai"] = Field("single_turn", description="single_turn, tool (Hermes-format tool calls), or openai (your agent).")
    tools: str | None = Field(
        None,
        description="tool loop: `module:TOOLS` or `file.py:TOOLS`, a dict of name -> callable, a list of callables or one "
        "callable; the model's JSON arguments are passed as keywords.",
    )
    entrypoint: str | None = Field(
        None,
        description="openai loop: `module:function` or `file.py:function` of your agent, called per sample as "
        "agent(task, base_url=..., api_key=...); it talks to the policy with openai.OpenAI(base_url=base_url, "
        "api_key=api_key) and returns its reward, or None to leave scoring to reward.function.",
    )
    session_timeout_s: float = Field(
        120.0, gt=0.0, description="openai loop: an agent that has run this long ends its session (timeout); its own time, "
        "not counting the time its calls wait for the model (that grows with the batch and the machine's load).",
    )
    batch_window_ms: float = Field(
        20.0, gt=0.0, description="openai loop: calls arriving within this of each other are generated in one batch."
    )
    max_turns: int = Field(4, ge=1, description="Assistant turns per session; one still calling tools after them ends the session.")
    max_calls_per_turn: int = Field(4, ge=1, description="Tool calls run per assistant turn.")
    tool_timeout_s: float = Field(5.0, gt=0.0, description="A call past this shows the model a timeout error.")
    tool_memory_mb: int = Field(512, ge=16, description="What one call may allocate beyond its worker's own memory.")
    tool_output_max_chars: int = Field(1000, ge=16, description="Longer outputs are cut (and say so).")
    tool_workers: int = Field(2, ge=1, description="Processes running tool calls in parallel.")
    tool_response_template: str = Field("<tool_response>\n{output}\n</tool_response>", description="Wraps each output.")
    tool_turn_template: str = Field(
        "\n<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n",
        description="The tokens between an assistant turn's end token and the next turn: the wrapped outputs "
        "(joined by newlines) as the chat template renders tool messages (Qwen's, by default).",
    )

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        if (self.loop == "tool") != (self.tools is not None):
            raise ValueError("agent.tools names the tools of the tool loop: set both agent.loop: tool and agent.tools, or neither.")
        if (self.loop == "openai") != (self.entrypoint is not None):
            raise ValueError("agent.entrypoint names the agent of the openai loop: set both agent.loop: openai and agent.entrypoint, or neither.")
        if "{output}" not in self.tool_response_template or "{responses}" not in self.tool_turn_template:
            raise ValueError("agent.tool_response_template needs {output}, and agent.tool_turn_template {responses}.")
        return self


class AdvantageConfig(Frozen):
    """How a group's rewards become advantages."""

    estimator: Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "pass_at_k", "opo"] = Field(
        "grpo", description="opo: reward minus the group's response-length-weighted mean reward."
    )
    eps: float = Field(1e-4, gt=0.0, description="Added to the group std (GRPO) to avoid dividing by zero.")
    pass_at_k: int = Field(4, gt=0, description="k of the pass@k estimator.")
    correct_threshold: float = Field(0.5, description="pass@k: a reward above this counts as correct.")


class LossConfig(Frozen):
    """The clipped policy-gradient loss (PPO/GRPO), its aggregation and optional KL term."""

    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="Lower clip range of the ratio.")
    clip_eps_high: float = Field(0.2, gt=0.0, description="Clip-higher (DAPO) when larger than clip_eps_low.")
    dual_clip_c: float | None = Field(None, gt=1.0, description="Dual-clip bound for negative advantages.")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How token losses become the batch loss: over all tokens, or per sequence first; "
        "seq-mean-token-sum-norm is Dr.GRPO's: each sequence's sum over norm_length.",
    )
    norm_length: int | None = Field(
        None, gt=0, description="seq-mean-token-sum-norm's constant divisor; default rollout.max_new_tokens (Dr.GRPO's max length).",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to the initial (reference) model; 0 loads none.")
    kl_type: Literal["k1", "k2", "k3"] = Field("k3", description="Estimator of the KL term.")
    mask_truncated: bool = Field(
        False,
        description="DAPO's overlong filtering: a response cut at its token budget stays in its group's baseline "
        "but is left out of the loss.",
    )
    rollout_is: RolloutISConfig = Field(default_factory=RolloutISConfig)
    router_aux_coef: float = Field(
        0.0,
        ge=0.0,
        description="MoE policies: weight of the router's load-balancing loss (Switch Transformer's, over the "
        "trained tokens). Off by default: RL starts from a balanced router and a short run rarely unbalances it.",
    )


class OptimConfig(Frozen):
    """AdamW and its learning-rate schedule."""

    lr: float = Field(3e-4, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field("constant", description="Decay after warmup_steps, to min_lr_ratio x lr.")
    warmup_steps: int = Field(0, ge=0, description="Counted in optimizer steps.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="The lr a decaying schedule ends at, as a fraction of lr.")


class TrainWorkerConfig(Frozen):
    """The trainer: how batches are split, laid out and computed."""

    optimizer_steps: int = Field(1, gt=0, description="Mini-batches (optimizer steps) per rollout batch.")
    pack_max_length: int = Field(4096, gt=0, description="Token budget of one micro-batch.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass: less memory, more compute.")
    freeze_vision: bool = Field(
        True, description="A vision-language policy's vision tower (and its merger) stays as loaded; false trains it too."
    )
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
    attention_kernel: Literal["torch", "fa4"] = Field(
        "torch",
        description="The flash-attention kernel of packed rows on GPU. torch: PyTorch's own (FA2). fa4: "
        "FlashAttention-4 (pip install 'trellis[fa4]'; Hopper or Blackwell): 2x FA2's attention speed on 8k-token "
        "sequences on an H200, 1.25x on GRPO-length ones. Layout packed (or auto on GPU) only.",
    )
    logprob_keep_logits: bool = Field(
        True,
        description="Keep each chunk's logits in the compute dtype until the backward pass instead of recomputing "
        "them there: one output-layer matmul per labelled token less (1.03x training speed for a 3B model on an "
        "H200), for labelled tokens x vocabulary x 2 bytes held per micro-batch in bf16 (2.5 GB for 8k labels "
        "over a 152k vocabulary). False bounds the head to one chunk of logits.",
    )
    fsdp: bool = Field(
        False,
        description="Wrap the policy with FSDP2 (fully_shard): fp32 master weights and AdamW states, bf16 compute "
        "from a mixed-precision policy, shards over the trainer's GPUs. Off: one GPU under bf16 autocast, which "
        "measured 1.6x faster than FSDP2 at world size 1 on an H200 (bench/gpu/train_mfu.py). Several trainer "
        "ranks (train_resources.num_workers) always shard.",
    )
    hsdp_shard_size: int | None = Field(
        None,
        gt=0,
        description="Trainer ranks that shard one copy of the model (HSDP: num_workers / hsdp_shard_size copies, "
        "e.g. the GPUs of one node, gradients all-reduced between copies). Default: all ranks shard one copy.",
    )
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile the decoder (fuses the norms, rotary and activations between the matmuls; "
        "1.37x training tokens/s for a 0.5B model on an H200). A machine's first compiled run pays the "
        "compile on its first steps; later runs find it in torch's caches (docs/gpu.md). auto: on for a "
        "dense text policy in packed rows on one CUDA GPU, where it was measured to gain, with a layer "
        "that fails to compile left eager; off elsewhere (CPU, fsdp, LoRA, MoE, vision-language), where "
        "true turns it on.",
    )
    compile_scope: Literal["layers", "decoder"] = Field(
        "layers",
        description="With compile: each decoder layer on its own (identical layers share one graph, except under layout "
        "shared_prefix, whose KV cache gives each layer its own; ~30 s of compile for a 0.5B model on an H200), or the "
        "whole decoder as one graph (fewer host calls per step: 1.17x the tokens/s of layers there, but ~6 min of compile).",
    )
    cuda_graphs: bool = Field(
        False,
        description="With compile and packed rows on a GPU: replay the compiled decoder as CUDA graphs "
        "(torch.compile's reduce-overhead mode), so the host no longer launches each kernel. Every packed row "
        "is filled to pack_max_length so that one graph serves every micro-batch; the fill is computed. The "
        "graphs keep their memory while the trainer is offloaded, so this suits a trainer that owns its GPU.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda where there is a GPU, else cpu.")
    routing_replay: Literal["none", "r2", "r3"] = Field(
        "none",
        description="MoE policies: which routing the trainer's forward passes use for response tokens. r3: the "
        "experts the rollout engine chose (rollout routing replay); r2: the experts the trainer chose for the "
        "old-policy logprobs, kept through the update. The gate weights always come from the trainer's router, "
        "so it keeps learning. Prompt tokens and responses without a recorded routing route normally (counted as "
        "router/fallback_sequences). The shared_prefix layout gives way to padded rows while replaying.",
    )
    offload_when_idle: Literal["auto"] | bool = Field(
        "auto",
        description="Colocated on a GPU: true moves the weights and AdamW state to CPU while the rollout runs (as "
        "XTuner does), false keeps them on the GPU. auto keeps them there when the GPU holds them and the rollout "
        "engine's share (rollout.gpu_memory_utilization) at once, decided at every hand-over; this saves two host "
        "transfers per step. A rollout backend without a fixed share (transformers on the GPU) gets the GPU alone.",
    )

    @field_validator("offload_when_idle", mode="before")
    @classmethod
    def _check_offload_when_idle(cls, value: Any) -> Any:
        if value == "auto" or isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"{value!r}: give auto, true or false")

    @model_validator(mode="after")
    def _check_layout(self) -> TrainWorkerConfig:
        if self.layout == "shared_prefix" and self.gradient_checkpointing:
            raise ValueError(
                "train_worker.layout: shared_prefix needs the prompts' KV cache, which gradient checkpointing "
                "drops; use layout: packed or padded, or turn gradient_checkpointing off."
            )
        if self.attention_kernel == "fa4" and self.layout not in ("auto", "packed"):
            raise ValueError(
                f"train_worker.attention_kernel: fa4 runs packed rows; layout is {self.layout}. Use layout: packed "
                "(or auto), or attention_kernel: torch."
            )
        if self.cuda_graphs:
            conflicts = {
                "compile is off (the graphs are compiled code)": self.compile is False,
                f"layout is {self.layout} (rows of one shape need packed)": self.layout not in ("auto", "packed"),
                "fsdp is on": self.fsdp,
                "gradient_checkpointing is on": self.gradient_checkpointing,
            }
            found = [reason for reason, conflict in conflicts.items() if conflict]
            if found:
                raise ValueError(f"train_worker.cuda_graphs: {'; '.join(found)}. CUDA graphs run compiled, packed rows "
                                 "without fsdp or gradient checkpointing.")
        return self


class TaskConfig(Frozen):
    """One task of a multi-task run: its prompts, how its samples are made and scored, and its share of
    each batch. Unset fields take the run's (``agent``, ``reward``, ``rollout.*``)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Also the task_name of its samples, and its metrics' prefix.")
    weight: float = Field(1.0, gt=0.0, description="Each group of a batch is drawn from a task with probability weight / total.")
    train_dataset: DatasetConfig
    eval_dataset: DatasetConfig | None = None
    agent: AgentConfig | None = None
    reward: RewardConfig | None = None
    temperature: float | None = Field(None, ge=0.0, description="Training rollouts of this task; evaluation keeps rollout.eval_temperature.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    max_new_tokens: int | None = Field(None, gt=0, description="This task's cap on response tokens, below rollout.max_new_tokens.")


class ResourcesConfig(Frozen):
    """What one side of a run holds (XTuner's ``AcceleratorResourcesConfig``): trainer ranks (one FSDP
    group) or rollout workers (engines the controller spreads groups over)."""

    num_workers: int = Field(1, ge=1, description="Trainer ranks, or rollout workers, of this side.")
    accelerators_per_worker: float = Field(
        1.0, gt=0.0, description="GPUs per worker on a cluster with GPUs; CPUs per worker on a CPU cluster."
    )


class ReplayBufferConfig(Frozen):
    """The buffer of scored groups (XTuner's Sync/AsyncReplayBufferConfig, with the staleness knobs of its
    produce strategy): the disaggregated trainer's, or a colocated run's with ``over_sample_threshold``.
    Staleness of a sample trained at step t is t - v - 1, v the policy version of its oldest token: 0 for
    data made by the weights just before t (XTuner's token staleness)."""

    kind: Literal["sync", "async"] = Field(
        "sync", description="Which buffered groups a step takes first: sync the oldest, async the stalest."
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="How many weight syncs behind a sample may be when trained: the producer runs at most "
        "(max_staleness + 1) x sync_weights_interval steps ahead, and older buffered groups expire.",
    )
    enable_partial_rollout: bool = Field(
        False,
        description="On a pause for weight sync, stop generating at once and keep what each sample has; it is "
        "continued with the new weights (each token records its policy version). Off: the pause waits for the "
        "generation in progress.",
    )
    mask_offpolicy_in_partial_rollout: bool = Field(
        False, description="Leave out of the loss the tokens a continued sample got from an older policy (slime's option)."
    )
    over_sample_threshold: float = Field(
        0.0,
        ge=0.0,
        description="trainer: colocated only. Each step launches train_batch_size x (1 + this) groups and trains "
        "the first train_batch_size that end; the rest are stopped then and kept for the next step: continued "
        "with enable_partial_rollout (within max_staleness), else started again from their prompt. Groups that "
        "ended beyond the batch are trained first next step. 0: every group of a step is generated to its end.",
    )
    tail_batch_trigger_size: int = Field(
        0,
        ge=-1,
        description="Expired groups: 0 generates them again before any new prompt, so every prompt of an epoch is "
        "trained once; -1 drops them (the ledger then records those prompts as never trained); N > 0 sets them aside "
        "in a tail lane until N have gathered, then generates them together in a round without new prompts and trains "
        "them before any other group (XTuner's tail batch). Groups still in the lane when the run ends stay open.",
    )


class LoadCheckpointConfig(Frozen):
    """An explicit checkpoint to start from (``auto_resume`` finds the latest one by itself)."""

    checkpoint_path: Location | None = Field(None, description="A checkpoints/step-NNNNNN folder (any fsspec URI).")
    load_optimizer_states: bool = Field(True, description="False: fresh AdamW moments. The lr, betas and weight decay are always this run's own settings.")
    load_dataset: bool = Field(True, description="False: restart the prompt order instead of continuing it.")
    load_scheduler: bool = Field(True, description="False: the learning-rate schedule starts again from its first step (its warm-up too).")


