"""FP8 rollout's settings are refused, with what to change, wherever they cannot work: a backend that
does not quantize, a LoRA adapter sync (which would leave fused layers half-loaded), a machine without
FP8 compute. Generation in FP8 itself needs a GPU: bench/gpu/vllm_learning.py --quantization fp8."""

from __future__ import annotations

import pytest
import torch

from trellis.engine.config.loading import ConfigError
from trellis.engine.errors import SettingError
from trellis.engine.rollout.backends.vllm_backend import VllmRollout, fp8_unavailable
from trellis.engine.weights.lora import sends_adapters
from helpers import tiny_config


def test_fp8_needs_a_backend_that_quantizes_and_full_syncs(tiny_model, reverse_data, tmp_path):
    """Tried: fp8 on the transformers backend, and fp8 on vLLM with an explicit LoRA adapter sync: both
    problems are reported at once. With lora.sync auto an FP8 run syncs merged weights, wherever its
    engines are."""
    with pytest.raises(ConfigError) as refused:
        tiny_config(tiny_model, reverse_data, tmp_path, rollout={"quantization": "fp8"}, lora={"sync": "adapter"})
    message = str(refused.value)
    assert "rollout.quantization: fp8 needs a backend that generates in FP8" in message
    assert "lora.sync: adapter cannot feed an FP8 engine" in message

    config = tiny_config(tiny_model, reverse_data, tmp_path, rollout={"backend": "vllm", "quantization": "fp8"}, lora={})
    assert not sends_adapters(config, "object_store") and not sends_adapters(config, "nccl")
    unquantized = tiny_config(tiny_model, reverse_data, tmp_path, rollout={"backend": "vllm"}, lora={})
    assert sends_adapters(unquantized, "object_store") and not sends_adapters(unquantized, "cuda_ipc")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU is what is tried")
def test_an_fp8_engine_on_a_machine_without_fp8_compute_is_refused_before_vllm_starts(tiny_model):
    """Tried: building the vLLM backend with quantization fp8 here (no GPU): a SettingError that says why
    and what to set, raised before vLLM is imported (it is not installed on CPU machines)."""
    reason = fp8_unavailable()
    assert reason == "there is no GPU"
    with pytest.raises(SettingError, match=rf"rollout.quantization: fp8 cannot run here: {reason}\. Set quantization: none"):
        VllmRollout(str(tiny_model), tokenizer=None, quantization="fp8")
