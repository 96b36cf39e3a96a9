"""What verl is asked to run in verl_peer.py: trl_peer's prompts in verl's dataset format, the Hydra
overrides (the shared workload, and the departures from verl 0.9.1's defaults whose reasons
verl_peer.py's docstring gives), the environment of verl's driver, and the settings read back from the
config its Hydra run saved; ``dry_run`` checks all of it against verl's own code on a CPU."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from run_facts import files_digest, weights_digest
from peer_workload import GPU, TOKENS_COUNTED, WORK

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
REWARD_FILE = HERE / "verl_reward.py"


def verl_data(model: Path, data: Path, max_prompt_length: int) -> tuple[Path, Path]:
    """trl_peer.py's prompts in verl's RL dataset format: ``prompt`` as chat messages, ``data_source``,
    ``reward_model.ground_truth``, ``extra_info.index``; the validation file (verl builds its loader even
    with validation off) is the first 32 rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    rows = pq.read_table(data).to_pylist()
    records = [{"data_source": r["data_source"], "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "reverse",
                "reward_model": {"style": "rule", "ground_truth": r["label"]}, "extra_info": {"index": i, "split": "train"}}
               for i, r in enumerate(rows)]
    tokenizer = AutoTokenizer.from_pretrained(model)
    longest = max(len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
                  for r in records)
    if longest > max_prompt_length:
        raise SystemExit(f"--max-prompt-length {max_prompt_length}: the longest prompt has {longest} tokens")
    train, val = WORK / "verl_train.parquet", WORK / "verl_val.parquet"
    pq.write_table(pa.Table.from_pylist(records), train)
    pq.write_table(pa.Table.from_pylist(records[:32]), val)
    return train, val


def overrides(args: argparse.Namespace, model: Path, train: Path, val: Path, round_: int) -> list[str]:
    """verl's Hydra overrides for the shared workload; every key exists in verl 0.9.1's ppo_trainer config
    (``+`` adds the two that are empty there)."""
    step = GPU
    micro = step["prompts"] * step["group"] // step["accumulation"]  # 32, TRL's per-device batch
    o = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"data.train_batch_size={step['prompts']}",
        f"data.max_prompt_length={args.max_prompt_length}",
        f"data.max_response_length={step['new_tokens']}",
        f"actor_rollout_ref.model.path={model}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.model.use_remove_padding={not args.no_remove_padding}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={not args.no_grad_ckpt}",
        f"actor_rollout_ref.actor.optim.lr={step['lr']}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={step['prompts']}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.kl_loss_coef=0.0",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={step['group']}",
        f"actor_rollout_ref.rollout.temperature={step['temperature']}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.vllm_memory}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.ignore_eos={not args.keep_eos}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"reward.custom_reward_function.path={REWARD_FILE}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=[console,file]",
        "trainer.project_name=trellis_bench",
        f"trainer.experiment_name=verl_peer_{round_}",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={WORK / 'verl_checkpoints'}",
        f"trainer.total_training_steps={args.steps}",
        "+ray_kwargs.ray_init.include_dashboard=False",
        "+ray_kwargs.ray_init.address=local",  # a cluster of its own, inheriting this environment, never one left running
        f"hydra.run.dir={WORK / f'verl_hydra_{round_}'}",
    ]
    return o + list(args.set)


def verl_env(args: argparse.Namespace, metrics: Path) -> dict[str, str]:
    """The environment of verl's driver; its local Ray cluster, and so every worker, the vLLM server and
    its engine processes, inherit it (ray.init starts the cluster from this process)."""
    env = dict(os.environ)
    site = os.environ.get("TRELLIS_VLLM_SITE")
    paths = [str(REPO), *([site] if site else []), env.get("PYTHONPATH", "")]
    env.update({
        "PYTHONPATH": ":".join(p for p in paths if p),
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": env.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),  # flashinfer is not carried
        "OMP_NUM_THREADS": str(args.torch_threads),  # Ray keeps a set value: trl_peer's torch threads
        "RAY_DEDUP_LOGS": "0",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def verl_settings(args: argparse.Namespace, hydra_config: Path, model: Path, train: Path) -> dict:
    """The settings verl ran with, read back from the config its Hydra run saved (trl_peer.py's rows)."""
    from omegaconf import OmegaConf

    c = OmegaConf.load(hydra_config)
    arr, actor, rollout = c.actor_rollout_ref, c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout
    fsdp = actor.fsdp_config
    kl = actor.kl_loss_coef if actor.use_kl_loss else 0.0
    if c.algorithm.use_kl_in_reward:
        kl = c.algorithm.kl_ctrl.kl_coef
    return {
        "model (weights digest)": f"{Path(arr.model.path).name} ({weights_digest(Path(arr.model.path))})",
        "prompts file digest": files_digest([WORK / "train.parquet"]),  # verl_train.parquet is written from it, row for row
        "prompts x samples per step": f"{c.data.train_batch_size} x {rollout.n}",
        "max new tokens": c.data.max_response_length,
        "rollout engine": rollout.name,
        "vLLM gpu_memory_utilization": rollout.gpu_memory_utilization,
        "temperature": rollout.temperature,
        "learning rate": actor.optim.lr,
        "KL coefficient": float(kl),
        "optimizer steps per batch": actor.ppo_epochs * (c.data.train_batch_size // actor.ppo_mini_batch_size),
        "trainer resident (no offload)": not (fsdp.param_offload or fsdp.optimizer_offload),
        "torch threads (CPU ops)": args.torch_threads,
        "activation checkpointing": arr.model.enable_gradient_checkpointing,
        "weights / compute dtype": f"{'float32' if fsdp.model_dtype in ('fp32', 'float32') else fsdp.model_dtype} / "
                                   f"{'bfloat16' if fsdp.dtype in ('bf16', 'bfloat16') else fsdp.dtype}",
        "compiled": actor.use_torch_compile,
        "tokens counted": TOKENS_COUNTED,
        "tokens counted from": "step metrics: response_length/mean x samples",
    }


def verl_defaults_kept(hydra_config: Path) -> dict:
    """verl-only facts that shape its step, outside the settings table the sides share."""
    from omegaconf import OmegaConf

    saved = OmegaConf.load(hydra_config)
    return {
        "vLLM sleeps after each rollout (rollout.free_cache_engine)": saved.actor_rollout_ref.rollout.free_cache_engine,
        "packed sequences (model.use_remove_padding)": saved.actor_rollout_ref.model.use_remove_padding,
        "dynamic batch size (actor.use_dynamic_bsz)": saved.actor_rollout_ref.actor.use_dynamic_bsz,
        "attention": saved.actor_rollout_ref.model.override_config.get("attn_implementation", "flash_attention_2"),
        "samples run to max new tokens (rollout.ignore_eos)": saved.actor_rollout_ref.rollout.ignore_eos,
        "trainer (trainer.use_v1, v1.trainer_mode)": f"{saved.trainer.use_v1}, {saved.trainer.v1.trainer_mode}",
    }


def dry_run(args: argparse.Namespace, model: Path, train: Path, val: Path) -> None:
    """On a CPU: compose verl's config with the overrides (every key must exist), check it as verl's
    main does, load the dataset with verl's own class and score a response with the reward file."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.dataset.rl_dataset import RLHFDataset

    plain = [o for o in overrides(args, model, train, val, 1) if not o.startswith("hydra.")]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(config_name="ppo_trainer", overrides=plain)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    OmegaConf.resolve(config)
    (args.out / "verl_dry_run_config.yaml").write_text(OmegaConf.to_yaml(config))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = RLHFDataset(data_files=[str(train)], tokenizer=tokenizer, config=config.data)
    row = dataset[0]
    sys.path.insert(0, str(REWARD_FILE.parent))
    from verl_reward import compute_score

    answer = row["reward_model"]["ground_truth"]
    print(f"dataset: {len(dataset)} rows; row 0: {row['raw_prompt']} -> {answer!r}, data_source {row['data_source']}")
    print(f"reward: right {compute_score(row['data_source'], f' {answer}', answer)}, wrong {compute_score(row['data_source'], 'X', answer)}")
    print(f"need reference policy: {need_reference_policy(config)}, critic: {need_critic(config)}")
    print("overrides:\n  " + "\n  ".join(overrides(args, model, train, val, 1)))
