"""torch.compile for the policy's decoder, with or without CUDA graphs."""

from __future__ import annotations

import torch


def compile_decoder(model: torch.nn.Module, scope: str, *, cuda_graphs: bool = False) -> None:
    """Compile the decoder layers one by one (identical layers share one graph, so this compiles once)
    or the whole decoder as one graph (one call into compiled code per micro-batch instead of one per
    layer, for many times the compile time).

    Without CUDA graphs, lengths that vary between micro-batches are traced as dynamic instead of
    recompiled. With them (torch.compile's reduce-overhead mode) rows have one length, so shapes are
    left static and each graph is recorded once per layer and ``cu_seq_lens`` size.
    """
    options = {"mode": "reduce-overhead"} if cuda_graphs else {"dynamic": True}
    decoder = model.get_decoder()
    if scope == "decoder":
        decoder.compile(**options)
        return
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"train_worker.compile: {type(model).__name__} has no decoder.layers to compile.")
    for layer in layers:
        layer.compile(**options)
