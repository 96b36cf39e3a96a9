"""LoRA on the policy: the trainer learns low-rank adapters on a frozen base, and the rollout engines
receive the adapters alone."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from trellis.engine.config.base import Frozen

# Every linear layer of a Llama/Qwen-style decoder block: attention and MLP.
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Frozen):
    """Low-rank adapters (PEFT's LoRA) on the policy's linear layers; the base weights stay frozen."""

    rank: int = Field(16, gt=0, description="r: the adapters' inner dimension.")
    alpha: float = Field(32.0, gt=0, description="The adapters' output is scaled by alpha / rank.")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="Dropout on the adapters' input while training. Above 0 the trainer's logprobs no longer match "
        "the rollout's (which runs without dropout): the mismatch shows in the rollout-IS metrics.",
    )
    target_modules: tuple[str, ...] = Field(
        DECODER_LINEARS,
        min_length=1,
        description="Linear layers that get adapters, by the last part of their name (q_proj matches "
        "model.layers.N.self_attn.q_proj). A name that matches no linear layer of the policy is an error.",
    )
    sync: Literal["auto", "adapter", "full"] = Field(
        "auto",
        description="What a weight sync sends the rollout engines. adapter: the adapters alone (161 MB for rank 16 on "
        "a 7B model, against 15 GB), which each engine merges into the base weights it read from load_from (exact: "
        "the same merge the trainer's exports use). full: the merged weights, as a full fine-tune syncs. auto: full "
        "where that copies nothing (an engine in the trainer's process, or sharing its GPU through CUDA IPC: 0.15 s "
        "against the adapters' 0.9 s on a 7B model on an H200), the adapters everywhere else.",
    )
    export_merged: bool = Field(
        False,
        description="HF exports write the PEFT adapter folder (adapter_config.json, adapter_model.safetensors), and "
        "with this also the merged model under merged/ (loads with AutoModelForCausalLM.from_pretrained).",
    )

    @field_validator("target_modules")
    @classmethod
    def _check_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        blank = [name for name in names if not name.strip()]
        if blank:
            raise ValueError("lora.target_modules holds an empty name.")
        return names

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
