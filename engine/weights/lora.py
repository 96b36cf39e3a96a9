"""LoRA adapters on the wire: their names, the one merge both sides use, and the rollout side's merger.

A weight sync of a LoRA policy sends only the adapters, as ``{module}.lora_A`` ([rank, in]) and
``{module}.lora_B`` ([out, rank]) under the base model's module names. A rollout engine merges them into
the base weights it read from ``load_from`` itself, with ``merge_weight``, the function the trainer's
merged exports (checkpoints' HF exports, full syncs, weight checks) use too, so both sides hold the
same tensors to the bit.
"""

from __future__ import annotations

import json
from typing import Iterable, Iterator, Mapping

import torch
from safetensors import safe_open

from trellis.engine.config import TrellisConfig
from trellis.engine.devices import rollout_device
from trellis.engine.storage.checkpoints import downloaded
from trellis.engine.storage.store import Store

LORA_A, LORA_B = "lora_A", "lora_B"


def merge_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``base + scale * B @ A`` in float32, on ``base``'s device."""
    delta = lora_b.to(base.device, torch.float32) @ lora_a.to(base.device, torch.float32)
    return base.float() + delta * scale


def adapter_modules(adapter: Iterable[str]) -> list[str]:
    """The module names of an adapter payload's keys, in order."""
    return [name[: -len(LORA_A) - 1] for name in adapter if name.endswith(f".{LORA_A}")]


def payload_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def sends_adapters(config: TrellisConfig, transport: str) -> bool:
    """Whether a weight sync of this run sends LoRA adapters rather than merged weights, the full weights
    going by ``transport`` (``engine.cluster.weight_sync``, or "in_process"). ``lora.sync: auto`` sends
    the adapters unless the full weights would copy nothing on their way: to an engine of the trainer's
    process, or through CUDA IPC to one sharing its GPU, where on a 7B model they took 0.15 s against the
    adapters' 0.9 s (their merge reads the base from host memory; bench/results/h200_lora_2026-12-03)."""
    if config.lora is None or config.lora.sync == "full" or config.rollout.quantization != "none":
        return False  # an FP8 engine re-quantizes whole layers: it takes the merged weights
    return config.lora.sync == "adapter" or transport not in ("cuda_ipc", "in_process")


def adapter_merger(config: TrellisConfig) -> AdapterMerger:
    """The merger of a rollout engine of this run, merging on the engine's device."""
    return AdapterMerger(Store(config.load_from, config.storage_options), config.lora.scale, rollout_device(config))


class AdapterMerger:
    """The rollout side: keeps the base weights of the adapted modules (read once from the policy's HF
    folder, in their stored dtype, on CPU) and turns each adapter payload into merged weights by their
    base names, ready for the backend's ``load_weights``."""

    def __init__(self, load_from: Store, scale: float, device: str | torch.device = "cpu") -> None:
        self._source = load_from
        self._scale = scale
        self._device = torch.device(device)
        self._base: dict[str, torch.Tensor] = {}

    def merged(self, adapter: Mapping[str, torch.Tensor]) -> MergedWeights:
        modules = adapter_modules(adapter)
        missing = [f"{m}.weight" for m in modules if f"{m}.weight" not in self._base]
        if missing:
            loaded = read_hf_tensors(self._source, missing)
            if self._device.type == "cuda":  # copied to the GPU at every sync: from pinned memory, twice as fast
                loaded = {name: tensor.pin_memory() for name, tensor in loaded.items()}
            self._base.update(loaded)
        return MergedWeights(self, adapter, modules)

    def merge(self, adapter: Mapping[str, torch.Tensor], module: str) -> torch.Tensor:
        base = self._base[f"{module}.weight"].to(self._device, non_blocking=True)
        # float32: the backend casts to the dtype it serves in
        return merge_weight(base, adapter[f"{module}.{LORA_A}"], adapter[f"{module}.{LORA_B}"], self._scale)


class MergedWeights(Mapping[str, torch.Tensor]):
    """The merged weights of a sync, made one at a time as a backend reads them: a 7B model's adapted
    layers merged at once would take ~26 GB in float32."""

    def __init__(self, merger: AdapterMerger, adapter: Mapping[str, torch.Tensor], modules: list[str]) -> None:
        self._merger, self._adapter = merger, adapter
        self._module_of = {f"{module}.weight": module for module in modules}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._merger.merge(self._adapter, self._module_of[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._module_of)

    def __len__(self) -> int:
        return len(self._module_of)


def read_hf_tensors(folder: Store, names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` out of an HF folder's safetensors (one file, or shards with an index), on CPU."""
    index = folder.join("model.safetensors.index.json")
    if index.exists():
        with index.open("r") as handle:
            file_of = json.load(handle)["weight_map"]
    else:
        file_of = {name: "model.safetensors" for name in names}
    absent = [name for name in names if name not in file_of]
    if absent:
        raise KeyError(f"{folder.uri} holds no {absent[:3]} (of {len(absent)} names asked for).")
    found: dict[str, torch.Tensor] = {}
    for file in sorted({file_of[name] for name in names}):
        wanted = [name for name in names if file_of[name] == file]
        with downloaded(folder.join(file)) as local, safe_open(local, framework="pt") as handle:
            stored = set(handle.keys())
            if lost := [name for name in wanted if name not in stored]:
                raise KeyError(f"{folder.uri}/{file} holds no {lost[:3]}.")
            found.update({name: handle.get_tensor(name) for name in wanted})
    return found
