"""Which stored policy an offline job (evaluate, export) works on, and its weights.

A source is a run's complete trainer checkpoint (``checkpoints/step-N``: ``model.safetensors``, or
DCP shards under ``model/``; a LoRA run's hold ``adapter.safetensors`` or the adapters' shards) or an HF
folder (``hf/step-N``, any ``save_pretrained`` output, or a PEFT adapter folder over ``load_from``).
"""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal

import torch
from safetensors.torch import load_file

from trellis.engine.config import LoraConfig, TrellisConfig
from trellis.engine.storage.checkpoints import (
    CheckpointError,
    SaveStore,
    downloaded,
    is_local,
    load_object,
    read_full_weights,
    require_complete,
)
from trellis.engine.storage.store import Store
from trellis.engine.storage.lineage import checkpoint_step
from trellis.engine.train.lora import PolicyAdapters, from_peft_folder_state, lora_of_peft_folder, merged_weights
from trellis.engine.train.sharded_checkpoint import is_sharded, load_sharded
from trellis.engine.train.worker_checkpoint import ADAPTER_FILE
from trellis.engine.vision.models import policy_auto_class

PEFT_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class PolicySource:
    uri: str
    step: int
    kind: Literal["checkpoint", "hf"]


def resolve_source(config: TrellisConfig, checkpoint: str | None = None) -> PolicySource:
    """``checkpoint``: None (the run's latest complete checkpoint, else its latest HF export), a step
    number of the run, or the URI of a checkpoint or HF folder. A clear ``CheckpointError`` otherwise."""
    options = config.storage_options
    trainer = SaveStore(Store(config.checkpoint_uri, options))
    if checkpoint is None:
        latest = trainer.latest() or SaveStore(Store(config.hf_uri, options)).latest()
        if latest is None:
            raise CheckpointError(f"{config.run_uri} has no complete checkpoint or HF export yet.")
        step, uri = latest
        return PolicySource(uri, step, "checkpoint" if uri.startswith(config.checkpoint_uri) else "hf")
    if checkpoint.strip().isdigit():
        step = int(checkpoint)
        if not trainer.is_complete(step):
            complete = trainer.complete_steps()
            raise CheckpointError(
                f"{config.run_uri} has no complete checkpoint of step {step}; complete ones: {', '.join(map(str, complete)) or 'none'}."
            )
        return PolicySource(trainer.uri(step), step, "checkpoint")
    uri = checkpoint.rstrip("/")
    if Store(f"{uri}/config.json", options).exists() or Store(f"{uri}/{PEFT_CONFIG}", options).exists():
        return PolicySource(uri, checkpoint_step(uri) or 0, "hf")
    state = require_complete(Store(uri, options))  # says whether it is missing or incomplete
    return PolicySource(uri, int(state["step"]), "checkpoint")


@contextmanager
def local_folder(folder: Store) -> Iterator[str]:
    """A local copy of a folder (the folder itself when it is local)."""
    fs, path = folder.fs()
    if is_local(fs):
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        fs.get(f"{path.rstrip('/')}/", tmp, recursive=True)
        yield tmp


def load_policy(config: TrellisConfig, source: PolicySource) -> torch.nn.Module:
    """The policy model of ``source``, on CPU in float32, in eval mode; LoRA adapters (a PEFT folder, or
    a LoRA run's checkpoint) come merged into ``load_from``'s weights."""
    options = config.storage_options
    folder_store = Store(source.uri, options)
    if source.kind == "hf" and not folder_store.join(PEFT_CONFIG).exists():
        with local_folder(folder_store) as folder:
            return policy_auto_class(folder).from_pretrained(folder, dtype=torch.float32).eval()
    model = _base_policy(config)  # the architecture; its weights are replaced
    if source.kind == "hf":
        with folder_store.join(PEFT_CONFIG).open("r") as handle:
            lora = lora_of_peft_folder(json.load(handle))
        with downloaded(folder_store.join("adapter_model.safetensors")) as local:
            adapters = from_peft_folder_state(load_file(local))
        return _merged(config, model, lora, adapters, source.uri)
    state = load_object(folder_store.join("trainer.pt"))
    if state.get("lora") is not None:
        lora = LoraConfig.model_validate(state["lora"])
        if is_sharded(folder_store):
            injected = PolicyAdapters(model, lora, where=config.load_from)
            load_sharded(folder_store, model, None, trainable_only=True)
            return _plain(config, injected.merged(model.state_dict()))
        with downloaded(folder_store.join(ADAPTER_FILE)) as local:
            adapters = load_file(local)
        return _merged(config, model, lora, adapters, source.uri)
    if is_sharded(folder_store):
        load_sharded(folder_store, model, None)
        return model.eval()
    tensors, aliases = read_full_weights(folder_store)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if not set(missing) <= set(aliases) or unexpected:
        raise CheckpointError(f"{source.uri} does not match {config.load_from}: missing {missing}, unexpected {unexpected}.")
    model.tie_weights()
    return model.eval()


def _base_policy(config: TrellisConfig) -> torch.nn.Module:
    with local_folder(Store(config.load_from, config.storage_options)) as folder:
        return policy_auto_class(folder).from_pretrained(folder, dtype=torch.float32)


def _merged(config: TrellisConfig, model: torch.nn.Module, lora: LoraConfig, adapters: dict, uri: str) -> torch.nn.Module:
    """A plain ``load_from`` policy holding ``model``'s base with ``adapters`` merged in."""
    try:
        weights = merged_weights(model, lora, adapters, where=uri)
    except ValueError as error:
        raise CheckpointError(str(error)) from error
    return _plain(config, weights)


def _plain(config: TrellisConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain ``load_from`` policy holding ``weights`` (by the base's names)."""
    plain = _base_policy(config)
    plain.load_state_dict(weights, strict=False)
    plain.tie_weights()
    return plain.eval()


def policy_weights(config: TrellisConfig, source: PolicySource) -> dict[str, torch.Tensor]:
    return dict(load_policy(config, source).state_dict())
