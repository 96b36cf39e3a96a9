"""LoRA on the trainer's policy: PEFT's adapters injected into the HF model in place (the model keeps its
class, so the decoder, output head, packing and FSDP code see the model they know), the base frozen.

The reference policy of the KL penalty is the same model with its adapters switched off: no second copy
of the weights, one more forward per micro-batch. Exports name tensors as the base model does: merged
weights for HF exports and full syncs, the adapters alone for an adapter sync (``engine.weights.lora``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer

from trellis.engine.config import LoraConfig
from trellis.engine.errors import SettingError
from trellis.engine.train import fsdp
from trellis.engine.weights.lora import LORA_A, LORA_B, merge_weight

ADAPTER = "default"  # PEFT's adapter name; a policy carries one
_BASE = ".base_layer."


def peft_config(lora: LoraConfig) -> PeftLoraConfig:
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules))


def linear_names(model: torch.nn.Module) -> set[str]:
    """The last parts of the names of the model's linear layers."""
    return {name.rsplit(".", 1)[-1] for name in _linears(model)}


def unmatched_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """target_modules names that match no linear layer of ``model`` (a meta-device model will do). A
    name matches as PEFT matches it: the whole module name, or its end after a dot."""
    linears = _linears(model)
    return [target for target in lora.target_modules if not any(n == target or n.endswith(f".{target}") for n in linears)]


def _linears(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def unmatched_problem(unmatched: list[str], linears: set[str], where: str) -> str:
    return (
        f"lora.target_modules: {', '.join(unmatched)} match no linear layer of {where}; its linear layers are "
        f"{', '.join(sorted(linears))}."
    )


class PolicyAdapters:
    """The adapters of one policy model: injected at construction, trained, switched off, exported."""

    def __init__(self, model: torch.nn.Module, lora: LoraConfig, *, where: str, seed: int = 0) -> None:
        """``seed`` draws the A matrices (B starts at zero): every trainer rank, and every run of one
        config, starts from the same adapters."""
        unmatched = unmatched_targets(model, lora)
        if unmatched:
            raise SettingError(unmatched_problem(unmatched, linear_names(model), where))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER)
        for name, param in model.named_parameters():
            trainable = is_adapter_name(name)
            param.requires_grad_(trainable)
            if trainable:
                param.data = param.data.float()  # adapters train in float32 whatever the base's dtype
        self._layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
        self.scale = lora.scale

    @contextmanager
    def switched_off(self) -> Iterator[None]:
        """The base policy for the duration: the reference model of the KL penalty.

        PEFT's ``enable_adapters(False)`` would also clear the adapters' ``requires_grad``; FSDP2 reads it
        when a sharded model first runs, so a reference pass first would leave the adapters' gradients
        unreduced across ranks. The flag its layers' forward reads is set alone instead."""
        for layer in self._layers:
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer in self._layers:
                layer._disable_adapters = False

    def adapter_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapters' tensors of a model state dict, by their names in the model (checkpoints)."""
        return {name: tensor for name, tensor in state.items() if is_adapter_name(name)}

    def sync_payload(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapters under the base model's module names: ``{module}.lora_A`` and ``{module}.lora_B``."""
        payload = {}
        for name, tensor in state.items():
            for part in (LORA_A, LORA_B):
                suffix = f".{part}.{ADAPTER}.weight"
                if name.endswith(suffix):
                    payload[f"{name[: -len(suffix)]}.{part}"] = tensor
        return payload

    def merged(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The policy as a plain model of the base's class would hold it: adapted layers merged."""
        out = {}
        for name, tensor in state.items():
            if is_adapter_name(name):
                continue
            if _BASE not in name:
                out[name] = tensor
                continue
            module, _, leaf = name.partition(_BASE)
            if leaf == "weight":
                lora_a = state[f"{module}.{LORA_A}.{ADAPTER}.weight"]
                lora_b = state[f"{module}.{LORA_B}.{ADAPTER}.weight"]
                tensor = merge_weight(tensor, lora_a, lora_b, self.scale).to(tensor.dtype)
            out[f"{module}.{leaf}"] = tensor
        return out


def is_adapter_name(name: str) -> bool:
    return f".{LORA_A}." in name or f".{LORA_B}." in name


def peft_folder_state(adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model-state adapter names as a PEFT adapter folder stores them (``PeftModel.from_pretrained``)."""
    return {f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": t.contiguous() for name, t in adapters.items()}


def from_peft_folder_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``peft_folder_state``: a PEFT adapter folder's names as the model state names them."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("base_model.model.")
        for part in (LORA_A, LORA_B):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[name] = tensor
    return out


def lora_of_peft_folder(adapter_config: Mapping[str, object]) -> LoraConfig:
    """The adapter shape an ``adapter_config.json`` describes."""
    targets = adapter_config["target_modules"]
    targets = [targets] if isinstance(targets, str) else sorted(targets)
    return LoraConfig(rank=adapter_config["r"], alpha=adapter_config["lora_alpha"], target_modules=tuple(targets))


def merged_weights(model: torch.nn.Module, lora: LoraConfig, adapters: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The weights of base policy ``model`` with ``adapters`` (model-state names) merged in, by the base's
    names. ``model`` keeps the adapters injected: load the result into a plain copy."""
    policy = PolicyAdapters(model, lora, where=where)
    load_adapters(model, adapters, where)
    return {name: tensor.detach() for name, tensor in policy.merged(model.state_dict()).items()}


def load_adapters(model: torch.nn.Module, adapters: Mapping[str, torch.Tensor], where: str) -> None:
    """Adapter tensors (model-state names) into a model with adapters injected, plain or sharded; a
    ValueError names what does not match."""
    missing, unexpected = fsdp.load_model_state(model, adapters)
    lost = [name for name in missing if is_adapter_name(name)]
    if lost or unexpected:
        raise ValueError(f"{where} does not match the model's adapters: missing {lost[:3]}, unexpected {unexpected[:3]}.")
