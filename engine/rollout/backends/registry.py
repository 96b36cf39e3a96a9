"""The rollout backend a config asks for, built by name: vLLM on a GPU, or the transformers loop
anywhere. Each name here is a row of ``engine.config.backends.ROLLOUT_BACKENDS`` (what it needs)."""

from __future__ import annotations

from typing import Callable

import torch

from trellis.engine.config import TrellisConfig
from trellis.engine.devices import rollout_device
from trellis.engine.rollout.backends.base import RolloutBackend
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout


def _vllm(config: TrellisConfig, tokenizer) -> RolloutBackend:
    from trellis.engine.rollout.backends.vllm_backend import VllmRollout  # vLLM is an optional extra

    rollout = config.rollout
    return VllmRollout(
        config.load_from,
        tokenizer,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        max_model_len=config.max_prompt_length + rollout.max_new_tokens,
        sleep_level=rollout.sleep_level,
        seed=config.seed,
        capture_routing=config.captures_routing,
        quantization=rollout.quantization,
    )


def _transformers(config: TrellisConfig, tokenizer) -> RolloutBackend:
    """On the trainer's device, bf16 on GPU, fp32 on CPU."""
    device = rollout_device(config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return TransformersRollout(
        config.load_from, tokenizer, device=str(device), dtype=dtype, seed=config.seed, capture_routing=config.captures_routing
    )


BUILDERS: dict[str, Callable[[TrellisConfig, object], RolloutBackend]] = {"vllm": _vllm, "transformers": _transformers}


def build_rollout_backend(config: TrellisConfig, tokenizer) -> RolloutBackend:
    name = config.rollout.backend
    if name not in BUILDERS:
        raise ValueError(f"Unknown rollout backend {name!r}; trellis builds {', '.join(sorted(BUILDERS))}.")
    return BUILDERS[name](config, tokenizer)
