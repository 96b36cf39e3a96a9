"""Where the library versions trellis supports differ (torch, transformers), in one place: each shim
says which versions it bridges, so it can go once the older one is no longer supported. Ray's are in
``engine.cluster.compat``, the only package that may import Ray."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as flash_varlen_attention
except ImportError:  # pragma: no cover - older torch
    flash_varlen_attention = None

# Keyword arguments of varlen_attn differ between torch releases (is_causal / enable_gqa arrived later).
FLASH_VARLEN_PARAMS: frozenset[str] = frozenset(
    inspect.signature(flash_varlen_attention).parameters if flash_varlen_attention is not None else ()
)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass. transformers renamed the
    switch (``gradient_checkpointing_enable`` -> ``activation_checkpointing_enable``) in v5.2x."""
    enable: Callable[[], None] = (
        getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    )
    enable()


def nccl_group(store: Any, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A ProcessGroupNCCL with a timeout: its Options take it only under the private ``_timeout``
    in torch 2.11-2.13."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def close_group(group: dist.ProcessGroup, *, nccl: bool) -> None:
    """Drop this end of a group without waiting for its peer, which may be gone. NCCL's orderly
    shutdown waits for the peer, so its communicator is aborted; gloo groups gained ``shutdown``
    only in recent torch releases, and older ones are simply dropped."""
    end = getattr(group, "abort", None) if nccl else getattr(group, "shutdown", None)
    if end is not None:
        end()

