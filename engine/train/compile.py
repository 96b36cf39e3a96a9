"""torch.compile for the policy's decoder, with or without CUDA graphs, and what ``compile: auto`` picks."""

from __future__ import annotations

import logging
from typing import Any

import torch

from trellis.engine.config import TrainWorkerConfig

logger = logging.getLogger(__name__)


def compile_policy(model: torch.nn.Module, worker: TrainWorkerConfig, **policy) -> tuple[bool, bool]:
    """Compile ``model``'s decoder as ``worker`` (compile, compile_scope, cuda_graphs) says for this policy
    (``policy``: ``auto_compile_blocker``'s keywords); returns whether it is compiled, and with CUDA graphs."""
    cuda_graphs = worker.cuda_graphs and policy["device"].type == "cuda"
    if worker.cuda_graphs and not cuda_graphs:
        logger.warning("train_worker.cuda_graphs has no effect on %s; the decoder is compiled without them.", policy["device"])
    compiled = resolve_compile(worker.compile, cuda_graphs=cuda_graphs, **policy)
    if compiled:
        compile_decoder(model, worker.compile_scope, cuda_graphs=cuda_graphs, fall_back_to_eager=worker.compile == "auto")
        if policy["layout"] == "shared_prefix":
            logger.warning(
                "train_worker.compile with layout shared_prefix: the prompts' KV cache enters every decoder layer, so each "
                "layer compiles graphs of its own, and past torch's recompile limit (torch._dynamo.config.recompile_limit, "
                "%d) the remaining layers run eager. layout: packed or padded compiles one graph for all layers.",
                torch._dynamo.config.recompile_limit,
            )
    return compiled, cuda_graphs


def resolve_compile(setting: bool | str, *, cuda_graphs: bool, **policy) -> bool:
    """What ``train_worker.compile`` comes to for this policy (``policy``: ``auto_compile_blocker``'s
    keywords), saying in the log why ``auto`` leaves a GPU policy eager."""
    if setting != "auto":
        return bool(setting)
    if cuda_graphs:  # the graphs replay compiled code
        return True
    blocker = auto_compile_blocker(**policy)
    if blocker is None:
        logger.info("train_worker.compile: auto compiles the decoder layers. A machine's first run pays the compile on "
                    "its first steps (13-27 s for 0.5B on an H100); torch's caches keep it for later runs. compile: false turns it off.")
    elif policy["device"].type == "cuda":
        logger.info("train_worker.compile: auto leaves the decoder eager: %s. compile: true compiles it anyway.", blocker)
    return blocker is None


def auto_compile_blocker(*, device: torch.device, layout: str, fsdp: bool, lora: bool, moe: bool, vision: bool) -> str | None:
    """Why ``compile: auto`` leaves this policy eager, or None to compile it.

    Auto compiles what was measured to gain: a dense text policy in packed rows on one CUDA GPU
    (bench/gpu/trl_peer.py, bench/gpu/compile_cost.py). Elsewhere the compile costs minutes of CPU
    or has not been measured, so set ``compile: true`` to have it anyway.
    """
    reasons = {
        f"the trainer runs on {device.type}": device.type != "cuda",
        f"the layout is {layout}, not packed": layout != "packed",
        "the policy is sharded (fsdp)": fsdp,
        "the policy trains LoRA adapters": lora,
        "the policy is a mixture of experts": moe,
        "the policy is vision-language": vision,
    }
    found = [reason for reason, applies in reasons.items() if applies]
    return "; ".join(found) or None


def compile_decoder(model: torch.nn.Module, scope: str, *, cuda_graphs: bool = False, fall_back_to_eager: bool = False,
                    backend: Any = "inductor") -> None:
    """Compile the decoder layers one by one (identical layers share one graph, so this compiles once)
    or the whole decoder as one graph (one call into compiled code per micro-batch instead of one per
    layer, for many times the compile time).

    Without CUDA graphs, lengths that vary between micro-batches are traced as dynamic instead of
    recompiled. With them (torch.compile's reduce-overhead mode) rows have one length, so shapes are
    left static and each graph is recorded once per layer and ``cu_seq_lens`` size.

    The compile itself happens at the first forward pass. With ``fall_back_to_eager`` a layer that
    fails to compile runs eager, with torch's warning naming the error (``compile: auto``); else the
    error stops the fit (``compile: true``).
    """
    torch._dynamo.config.suppress_errors = fall_back_to_eager  # process-wide: a trainer's process holds one policy
    options: dict[str, Any] = {"mode": "reduce-overhead"} if cuda_graphs else {"dynamic": True}
    options["backend"] = backend
    decoder = model.get_decoder()
    if scope == "decoder":
        decoder.compile(**options)
        return
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"train_worker.compile: {type(model).__name__} has no decoder.layers to compile.")
    for layer in layers:
        layer.compile(**options)
