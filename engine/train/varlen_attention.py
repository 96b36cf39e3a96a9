"""Attention over packed rows: many sequences in one row, each attending only to itself.

The packed layout puts the sequences of a micro-batch end to end in a single row, with positions
restarting at every sequence and ``cu_seq_lens`` marking the boundaries. Registered with
transformers as ``trellis_varlen``, so no [T, T] mask is ever built and no pad token is computed.

On CUDA with bf16/fp16 inputs it runs PyTorch's flash-attention varlen kernel (FA2; forward and
backward), or with ``kernel="fa4"`` FlashAttention-4's CuTe kernels (the ``flash-attn-4`` package;
Hopper and Blackwell), 2x FA2's speed on 8k-token sequences on an H200
(bench/gpu/attention_kernels.py); elsewhere it runs causal SDPA on each sequence in turn, which
gives the same result.

A vision-language policy's vision tower gets the same treatment without the causal mask
(``trellis_flash_vision``): its windows and images go through one flash varlen call per layer.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from trellis.engine.compat import FLASH_VARLEN_PARAMS as _FLASH_PARAMS
from trellis.engine.compat import flash_varlen_attention as _flash_varlen

NAME = "trellis_varlen"
NAME_FA4 = "trellis_varlen_fa4"
# transformers hands a vision tower's windows to an attention as one varlen call only when its name
# says "flash"; under any other name Qwen-VL towers call it once per window (a 448-pixel image has 16),
# hundreds of small launches per layer that made the frozen tower 37% of an H200 image step's fit.
NAME_VISION = "trellis_flash_vision"
# Towers known to call their attention that way (and to need nothing else a "flash" name switches on).
VARLEN_VISION_TOWERS = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


def _packed_attention(flash, query, key, value, scaling, kwargs, *, causal: bool, attention_mask=None) -> tuple[torch.Tensor, None]:
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None and not causal:  # a vision tower that passes one window at a time
        gqa = query.size(1) != key.size(1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2), None
    if cu_seq_lens is None or query.size(0) != 1:
        raise ValueError(
            f"{NAME} attention runs packed rows only: one row with cu_seq_lens_q/max_length_q passed to the model."
        )
    if _flash_varlen is not None and query.is_cuda:
        dtype = _half_dtype(query)
        if dtype is not None:
            q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
            return flash(q, k, v, cu_seq_lens, int(kwargs["max_length_q"]), scaling).unsqueeze(0), None
    return _per_sequence(query, key, value, cu_seq_lens.tolist(), scaling, causal=causal), None


def _half_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype to run flash attention in, or None to stay exact in float32.

    Under autocast, rotary embeddings computed in float32 promote q and k to float32; autocast would
    have run SDPA in its low-precision dtype, so the flash kernel does the same.
    """
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _flash(q_THD, k_THD, v_THD, cu_seq_lens, max_length, scaling, causal: bool = True) -> torch.Tensor:
    cu = cu_seq_lens.to(device=q_THD.device, dtype=torch.int32)
    options = {"scale": scaling}
    if q_THD.size(1) != k_THD.size(1):
        if "enable_gqa" in _FLASH_PARAMS:
            options["enable_gqa"] = True
        else:
            groups = q_THD.size(1) // k_THD.size(1)
            k_THD, v_THD = k_THD.repeat_interleave(groups, dim=1), v_THD.repeat_interleave(groups, dim=1)
    if "is_causal" in _FLASH_PARAMS:
        options["is_causal"] = causal
    else:
        options["window_size"] = (-1, 0) if causal else (-1, -1)
    return _flash_varlen(q_THD, k_THD, v_THD, cu, cu, max_length, max_length, **options)


@torch.compiler.disable  # CuTe kernels cannot be traced; compiled decoder layers run them between two graphs
def _fa4(q_THD, k_THD, v_THD, cu_seq_lens, max_length, scaling) -> torch.Tensor:
    from flash_attn.cute import flash_attn_varlen_func

    cu = cu_seq_lens.to(device=q_THD.device, dtype=torch.int32)
    out, _ = flash_attn_varlen_func(
        q_THD, k_THD, v_THD, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_length, max_seqlen_k=max_length,
        softmax_scale=scaling, causal=True,
    )
    return out


def fa4_unavailable(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on ``device``, or None when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA GPUs and the trainer runs on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10, 11):
        return f"it runs on Hopper and Blackwell GPUs (compute capability 9.x-11.x), not {major}.{minor}"
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return "the flash-attn-4 package is not installed (pip install 'trellis[fa4]')"
    return None


def _per_sequence(query, key, value, bounds: list[int], scaling, causal: bool = True) -> torch.Tensor:
    gqa = query.size(1) != key.size(1)
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=causal, scale=scaling, enable_gqa=gqa
        )
        for start, end in zip(bounds[:-1], bounds[1:])
        if end > start  # rows of fixed shape end with empty sequences
    ]
    return torch.cat(parts, dim=2).transpose(1, 2)


def _packed_rows(flash, causal: bool = True):
    """An attention function for transformers' ``AttentionInterface`` that runs packed rows with ``flash``:
    query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D] (transformers' convention). Not
    ``causal``: a vision tower's windows or images, attended both ways, which may also come one a call."""

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        return _packed_attention(flash, query, key, value, scaling, kwargs, causal=causal, attention_mask=attention_mask)

    return attention


varlen_attention = _packed_rows(_flash)
varlen_attention_fa4 = _packed_rows(_fa4)
vision_attention = _packed_rows(functools.partial(_flash, causal=False), causal=False)


def use_varlen_attention(model: torch.nn.Module, kernel: str = "torch") -> None:
    """Switch ``model`` (and its sub-models) to packed-row attention, run by PyTorch's flash kernel
    (``torch``) or FlashAttention-4 (``fa4``; check ``fa4_unavailable`` first)."""
    name, function = (NAME_FA4, varlen_attention_fa4) if kernel == "fa4" else (NAME, varlen_attention)
    AttentionInterface.register(name, function)
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        model.set_attn_implementation(name)
        return
    model.set_attn_implementation({"text_config": name, "vision_config": vision._attn_implementation or "sdpa"})
    if model.config.model_type in VARLEN_VISION_TOWERS:
        AttentionInterface.register(NAME_VISION, vision_attention)
        # Set on the config its modules read: set_attn_implementation would look for a flash-attn
        # package (or a hub kernel) behind any name that says "flash".
        vision._attn_implementation = NAME_VISION
