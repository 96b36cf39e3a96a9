"""Which stored policy an offline job (evaluate, export) works on, and its weights.

A source is a run's complete trainer checkpoint (``checkpoints/step-N``: ``model.safetensors``, or
DCP shards under ``model/``) or an HF folder (``hf/step-N``, or any ``save_pretrained`` output).
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal

import torch
from transformers import AutoModelForCausalLM

from trellis.engine.config import TrellisConfig
from trellis.engine.storage.checkpoints import (
    CheckpointError,
    SaveStore,
    is_local,
    read_full_weights,
    require_complete,
)
from trellis.engine.storage.store import Store
from trellis.engine.storage.lineage import checkpoint_step
from trellis.engine.train.sharded_checkpoint import is_sharded, load_sharded


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
    if Store(f"{uri}/config.json", options).exists():
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
    """The policy model of ``source``, on CPU in float32, in eval mode."""
    options = config.storage_options
    if source.kind == "hf":
        with local_folder(Store(source.uri, options)) as folder:
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with local_folder(Store(config.load_from)) as folder:  # the architecture; its weights are replaced
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if is_sharded(Store(source.uri, options)):
        load_sharded(Store(source.uri, options), model, None)
        return model.eval()
    tensors, aliases = read_full_weights(Store(source.uri, options))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if not set(missing) <= set(aliases) or unexpected:
        raise CheckpointError(f"{source.uri} does not match {config.load_from}: missing {missing}, unexpected {unexpected}.")
    model.tie_weights()
    return model.eval()


def policy_weights(config: TrellisConfig, source: PolicySource) -> dict[str, torch.Tensor]:
    return dict(load_policy(config, source).state_dict())
