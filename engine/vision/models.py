"""Which transformers auto class loads a policy: vision-language models (a config with a
``vision_config``) live under ``AutoModelForImageTextToText``, text models under
``AutoModelForCausalLM``; both give logits over the vocabulary from token ids."""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig


def is_vision_language(config: PretrainedConfig) -> bool:
    return getattr(config, "vision_config", None) is not None


def policy_auto_class(source: str | PretrainedConfig) -> Any:
    """The auto class for a model folder (or its config)."""
    config = AutoConfig.from_pretrained(source) if isinstance(source, str) else source
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
