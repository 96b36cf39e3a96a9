"""The rollout backend a config asks for: vLLM on a GPU, or the transformers loop anywhere."""

from __future__ import annotations

import torch

from engine.config import TrellisConfig
from engine.devices import rollout_device
from engine.rollout.base import RolloutBackend
from engine.rollout.transformers_backend import TransformersRollout


def build_rollout_backend(config: TrellisConfig, tokenizer) -> RolloutBackend:
    """vLLM when configured (GPU only); otherwise the transformers loop on the trainer's device,
    bf16 on GPU, fp32 on CPU."""
    rollout = config.rollout
    if rollout.backend == "vllm":
        from engine.rollout.vllm_backend import VllmRollout  # vLLM is an optional extra

        longest = config.max_prompt_length + rollout.max_new_tokens
        return VllmRollout(
            config.load_from,
            tokenizer,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_model_len=longest,
            sleep_level=rollout.sleep_level,
            seed=config.seed,
        )
    device = rollout_device(config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return TransformersRollout(config.load_from, tokenizer, device=str(device), dtype=dtype, seed=config.seed)
