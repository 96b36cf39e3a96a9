"""The cross-field rules of a run's configuration. Each returns every problem it finds, as a sentence
that says what to change, so that a config with several mistakes is fixed in one go."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trellis.engine.config.backends import backend_traits

if TYPE_CHECKING:
    from trellis.engine.config.trellis import TrellisConfig


def interval_problems(config: TrellisConfig) -> list[str]:
    """Saves and evaluations run on weight-sync steps only, so their intervals must be multiples of it."""
    sync = config.sync_weights_interval
    if sync <= 0:
        return [f"sync_weights_interval must be positive, got {sync}."]
    problems = []
    for name in ("checkpoint_interval", "hf_interval"):
        interval = getattr(config, name)
        if interval is None or interval == -1:
            continue
        if interval <= 0:
            problems.append(f"{name} must be positive, or -1 / null to disable it; got {interval}.")
        elif interval % sync:
            problems.append(
                f"{name}={interval} must be a multiple of sync_weights_interval={sync}, because checkpoints and "
                "HF exports are written on weight-sync steps only."
            )
    if config.enable_evaluate:
        if config.evaluate_step <= 0:
            problems.append(f"evaluate_step must be positive when evaluation is enabled, got {config.evaluate_step}.")
        elif config.evaluate_step % sync:
            problems.append(
                f"evaluate_step={config.evaluate_step} must be a multiple of sync_weights_interval={sync}, because "
                "evaluation runs on weight-sync steps only."
            )
    if config.check_weights_interval and not backend_traits(config.rollout.backend).exports_served_weights:
        problems.append(
            f"check_weights_interval needs a rollout backend that exports the weights it serves; {config.rollout.backend} "
            "keeps its own layout: set check_weights_interval: 0."
        )
    for name in ("checkpoint_maxkeep", "hf_max_keep"):
        keep = getattr(config, name)
        if keep is not None and keep != -1 and keep <= 0:
            problems.append(f"{name} must be positive, or -1 / null to keep all; got {keep}.")
    return problems


def length_problems(config: TrellisConfig) -> list[str]:
    problems = []
    if not config.debug_train and config.total_train_steps is None and config.total_epochs is None:
        problems.append("Either total_train_steps or total_epochs must be set.")
    for name in ("total_train_steps", "total_epochs"):
        value = getattr(config, name)
        if value is not None and value <= 0:
            problems.append(f"{name} must be positive, got {value}.")
    return problems


def mode_problems(config: TrellisConfig) -> list[str]:
    problems = []
    if config.debug_rollout and config.debug_train:
        problems.append("debug_rollout and debug_train cannot both be enabled; pick one.")
    elif (config.debug_rollout or config.debug_train) and config.debug_rollout_dir is None:
        mode = "debug_rollout" if config.debug_rollout else "debug_train"
        problems.append(f"debug_rollout_dir must be set when {mode}=true.")
    if (config.enable_evaluate or config.enable_initial_evaluate) and not config.eval_datasets:
        where = "no task has an eval_dataset" if config.tasks else "eval_dataset is not set"
        problems.append(f"Evaluation is enabled but {where}; set one or enable_evaluate=false.")
    return problems


NAME_A_REWARD = "name the function that scores a sample, e.g. myreward:score (built in: trellis.engine.rollout.rewards:exact_match)"
NO_REWARD = f"reward.function: required, but not set; {NAME_A_REWARD}"


def reward_problems(config: TrellisConfig) -> list[str]:
    """Every sample is scored by a function the config names: trellis has no default task to score for."""
    if not config.tasks:
        return [] if config.reward.function else [NO_REWARD]
    problems = []
    for task in config.tasks:
        if task.reward is not None and not task.reward.function:
            problems.append(f"tasks[{task.name}].reward.function: required, but not set; {NAME_A_REWARD}")
        elif task.reward is None and not config.reward.function:
            problems.append(f"tasks[{task.name}] has no reward and reward.function is not set; {NAME_A_REWARD}")
    return problems


def task_problems(config: TrellisConfig) -> list[str]:
    if not config.tasks:
        return [] if config.train_dataset is not None else ["train_dataset: required, but not set (or tasks, for a multi-task run)"]
    problems = []
    if config.train_dataset is not None or config.eval_dataset is not None:
        problems.append("With tasks, each task has its own train_dataset and eval_dataset: leave the top-level ones unset.")
    names = [task.name for task in config.tasks]
    if len(set(names)) < len(names):
        problems.append(f"tasks need distinct names, got {names}.")
    for task in config.tasks:
        if task.max_new_tokens is not None and task.max_new_tokens > config.rollout.max_new_tokens:
            problems.append(
                f"tasks[{task.name}].max_new_tokens={task.max_new_tokens} exceeds rollout.max_new_tokens="
                f"{config.rollout.max_new_tokens}, the run's budget (and its trainer's packing)."
            )
        if task.reward is not None and task.reward.overlong_buffer_len:
            problems.append(f"tasks[{task.name}].reward.overlong_buffer_len: overlong shaping is the run's; set reward.overlong_buffer_len.")
    return problems


def algorithm_problems(config: TrellisConfig) -> list[str]:
    problems = []
    loss, advantage, group = config.loss, config.advantage, config.prompt_repeat_k
    if loss.clip_eps_high < loss.clip_eps_low:
        problems.append(
            f"loss.clip_eps_high={loss.clip_eps_high} is below loss.clip_eps_low={loss.clip_eps_low}; clip-higher "
            "only widens the upper bound."
        )
    if advantage.estimator in ("grpo", "rloo", "pass_at_k") and group < 2:
        problems.append(
            f"advantage.estimator={advantage.estimator!r} compares samples of one prompt: prompt_repeat_k must be "
            f"at least 2, got {group}."
        )
    if config.dynamic_sampling.enable and group < 2:
        problems.append(
            f"dynamic_sampling keeps groups whose rewards differ: prompt_repeat_k must be at least 2, got {group}."
        )
    buffer, budget = config.reward.overlong_buffer_len, config.rollout.max_new_tokens
    if buffer >= budget:
        problems.append(
            f"reward.overlong_buffer_len={buffer} must be below rollout.max_new_tokens={budget}: the penalty starts "
            "that many tokens before the budget."
        )
    if advantage.estimator == "pass_at_k" and advantage.pass_at_k > group:
        problems.append(f"advantage.pass_at_k={advantage.pass_at_k} exceeds prompt_repeat_k={group}.")
    worker = config.train_worker
    longest = config.max_prompt_length + config.rollout.max_new_tokens - 1
    if longest > worker.pack_max_length:
        problems.append(
            f"train_worker.pack_max_length={worker.pack_max_length} cannot hold a sample of "
            f"train_dataset.max_prompt_length + rollout.max_new_tokens - 1 = {longest} tokens; raise it or lower "
            "those two."
        )
    if config.train_batch_size * group < worker.optimizer_steps:
        problems.append(
            f"train_worker.optimizer_steps={worker.optimizer_steps} exceeds the {config.train_batch_size * group} "
            "samples of a batch."
        )
    return problems


def trainer_problems(config: TrellisConfig) -> list[str]:
    """The replay buffer's settings: the disaggregated trainer's, or a colocated run's that over-samples."""
    problems = []
    if not config.keeps_replay_buffer:
        if config.replay_buffer != type(config.replay_buffer)():
            problems.append(
                "replay_buffer is set, but only trainer: disaggregated, or a colocated run with "
                "replay_buffer.over_sample_threshold > 0, has a replay buffer."
            )
        if config.checkpoint_no_save_replay_buffer:
            problems.append("checkpoint_no_save_replay_buffer is set, but this run has no replay buffer.")
        return problems
    trainer = "trainer: disaggregated" if config.disaggregated else "replay_buffer.over_sample_threshold"
    if config.disaggregated and config.replay_buffer.over_sample_threshold > 0:
        problems.append(
            "replay_buffer.over_sample_threshold is for trainer: colocated; the disaggregated producer already "
            "generates ahead of the trainer (max_staleness bounds how far)."
        )
    if config.debug_rollout or config.debug_train:
        problems.append(f"{trainer} runs no debug mode; use trainer: colocated without it for debug_rollout or debug_train.")
    if not backend_traits(config.rollout.backend).supports_abort:
        problems.append(
            f"{trainer} stops generation in flight (for a weight sync, or once the batch is full), and "
            f"rollout.backend={config.rollout.backend} cannot abort it: use trainer: colocated without it."
        )
    for agent in config.agents:
        if agent.loop != "single_turn" and config.replay_buffer.enable_partial_rollout:
            problems.append(
                f"replay_buffer.enable_partial_rollout continues interrupted single responses; the {agent.loop} loop's "
                "sessions start over instead (their tools may have had effects): turn one of them off."
            )
            break
    if config.replay_buffer.mask_offpolicy_in_partial_rollout and not config.replay_buffer.enable_partial_rollout:
        problems.append("replay_buffer.mask_offpolicy_in_partial_rollout needs replay_buffer.enable_partial_rollout.")
    return problems


def routing_problems(config: TrellisConfig) -> list[str]:
    """Routing capture and replay need a backend that hands back routed experts; whether the policy is
    an MoE at all is checked against its checkpoint (engine.run.preflight, and the trainer)."""
    backend = config.rollout.backend
    if config.captures_routing and not backend_traits(backend).returns_routed_experts:
        setting = "train_worker.routing_replay: r3" if config.train_worker.routing_replay == "r3" else "rollout.return_routed_experts"
        return [
            f"{setting} needs the experts the rollout engine routed each token through, and rollout.backend={backend} "
            "cannot return them: use a backend that can (transformers), or routing_replay: r2 / none."
        ]
    return []


def precision_problems(config: TrellisConfig) -> list[str]:
    """FP8 rollout needs a backend that quantizes, and whole layers at every sync: a LoRA adapter sync loads
    only the adapted layers' weights, and a fused layer (qkv, gate_up) left half-loaded would be
    re-quantized with garbage."""
    quantization, backend = config.rollout.quantization, config.rollout.backend
    if quantization == "none":
        return []
    problems = []
    if not backend_traits(backend).quantizes_fp8:
        problems.append(
            f"rollout.quantization: {quantization} needs a backend that generates in FP8 (vllm, on a GPU with FP8 compute); "
            f"rollout.backend={backend} does not: set quantization: none."
        )
    if config.lora is not None and config.lora.sync == "adapter":
        problems.append(
            f"lora.sync: adapter cannot feed an FP8 engine (rollout.quantization: {quantization}), which re-quantizes "
            "whole layers from full weights: set lora.sync: auto or full."
        )
    return problems


def resource_problems(config: TrellisConfig) -> list[str]:
    """Several trainer ranks or rollout workers."""
    problems = []
    ranks, engines = config.train_resources.num_workers, config.rollout_resources.num_workers
    per_mini_batch = config.train_batch_size * config.prompt_repeat_k // config.train_worker.optimizer_steps
    if ranks > per_mini_batch:
        problems.append(
            f"train_resources.num_workers={ranks} exceeds the {per_mini_batch} samples of a mini-batch "
            "(train_batch_size x prompt_repeat_k / train_worker.optimizer_steps): every trainer rank needs one."
        )
    shard_size = config.train_worker.hsdp_shard_size
    if shard_size is not None and ranks % shard_size:
        problems.append(
            f"train_worker.hsdp_shard_size={shard_size} must divide train_resources.num_workers={ranks} (each copy of "
            "the model is sharded over that many ranks)."
        )
    if ranks > 1 and config.train_worker.cuda_graphs:
        problems.append("train_worker.cuda_graphs runs on one trainer rank; several ranks shard the model with FSDP.")
    if not config.disaggregated and ranks != engines and (backend_traits(config.rollout.backend).needs_gpu or config.train_worker.device == "cuda"):
        problems.append(
            f"A colocated run on GPUs puts one trainer rank and one rollout worker on each GPU: train_resources.num_workers "
            f"({ranks}) and rollout_resources.num_workers ({engines}) must be equal."
        )
    if not config.disaggregated:
        for side in ("train_resources", "rollout_resources"):
            if getattr(config, side).accelerators_per_worker != 1.0:
                problems.append(f"{side}.accelerators_per_worker: a colocated worker shares one GPU; set it with trainer: disaggregated.")
    return problems


def guard_problems(config: TrellisConfig) -> list[str]:
    guard = config.guard
    if not guard.enabled:
        return []
    problems = []
    if guard.on_trip == "rollback" and config.checkpoint_interval in (None, -1):
        problems.append("guard.on_trip: rollback needs checkpoints to roll back to; set checkpoint_interval (e.g. 2), or guard.on_trip: stop.")
    if guard.skip_batches and config.disaggregated:
        problems.append(
            "guard.skip_batches is for colocated runs: a disaggregated run's replay buffer holds prompts of the steps rolled "
            "back, so it draws them again; set guard.skip_batches: false."
        )
    if guard.min_history > guard.window:
        problems.append(f"guard.min_history ({guard.min_history}) cannot exceed guard.window ({guard.window}).")
    return problems


RULES = (
    task_problems, reward_problems, mode_problems, length_problems, interval_problems, algorithm_problems, trainer_problems,
    routing_problems, precision_problems, resource_problems, guard_problems,
)
