"""Checkpoints and HF exports through fsspec: a local folder or ``s3://`` alike.

Layout (one folder per step, ``{run}/checkpoints/step-000012/``):

    model.safetensors   policy weights (float32 master copy)
    optimizer.pt        AdamW state (absent with ``checkpoint_no_save_optimizer``)
    trainer.pt          applied step, lr-scheduler state, the trainer's RNG states
    controller.pt       prompt-sampler state, the controller's RNG states
    train_state.json    step, policy version, throughput counters
    COMPLETE            written last: a folder without it is never resumed from

Every worker writes its own files (as each rank of a distributed checkpoint would), then one
``seal`` writes ``train_state.json`` and the marker, records the folder in ``meta.json`` and prunes
old folders. Pruning never removes the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import fsspec
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trellis.engine.storage.store import Store

MARKER = "COMPLETE"
TRAIN_STATE = "train_state.json"
_STEP_DIR = re.compile(r"step-(\d{6})$")
_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or could not be read."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


class SaveStore:
    """The step folders under one root (``{run}/checkpoints`` or ``{run}/hf``)."""

    def __init__(self, root: Store) -> None:
        self.root = root.uri.rstrip("/")
        self._store = root
        self.fs, self._path = root.fs()

    def uri(self, step: int) -> str:
        return f"{self.root}/{step_name(step)}"

    def store(self, step: int) -> Store:
        """``step``'s folder, with the options of the root."""
        return self._store.join(step_name(step))

    def steps_on_disk(self) -> list[int]:
        """Steps with a folder, complete or not."""
        self.fs.invalidate_cache()
        if not self.fs.exists(self._path):
            return []
        steps = []
        for entry in self.fs.ls(self._path, detail=False):
            match = _STEP_DIR.search(entry.rstrip("/"))
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def is_complete(self, step: int) -> bool:
        return self.fs.exists(f"{self._path}/{step_name(step)}/{MARKER}")

    def complete_steps(self) -> list[int]:
        return [step for step in self.steps_on_disk() if self.is_complete(step)]

    def latest(self) -> tuple[int, str] | None:
        complete = self.complete_steps()
        return (complete[-1], self.uri(complete[-1])) if complete else None

    def begin(self, step: int) -> str:
        """An empty folder for ``step``: what an earlier, interrupted attempt left there is removed."""
        path = f"{self._path}/{step_name(step)}"
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        self.fs.makedirs(path, exist_ok=True)
        return self.uri(step)

    def seal(self, step: int, record: Mapping[str, Any] | None = None) -> None:
        """Mark ``step`` complete (its files must all be written) and record it in ``meta.json``."""
        with self.fs.open(f"{self._path}/{step_name(step)}/{MARKER}", "w") as handle:
            json.dump({"step": step, "sealed_at": time.time(), **(record or {})}, handle)
        self._write_meta()

    def unseal(self, step: int) -> None:
        """``step`` is no longer complete (its files stay): nothing resumes or rolls back to it."""
        self.fs.rm(f"{self._path}/{step_name(step)}/{MARKER}")
        self._write_meta()

    def prune(self, keep: int | None) -> list[int]:
        """Keep the newest ``keep`` complete folders (None or -1: all); drop incomplete leftovers older
        than the newest complete one. Returns the steps removed."""
        complete = self.complete_steps()
        if not complete:
            return []
        victims = {s for s in self.steps_on_disk() if s < complete[-1] and s not in complete}
        if keep is not None and keep > 0:
            victims.update(complete[:-keep])
        for step in sorted(victims):
            self.fs.rm(f"{self._path}/{step_name(step)}", recursive=True)
        if victims:
            self._write_meta()
        return sorted(victims)

    def _write_meta(self) -> None:
        meta = {"complete": [{"step": s, "uri": self.uri(s)} for s in self.complete_steps()]}
        with self.fs.open(f"{self._path}/meta.json", "w") as handle:
            json.dump(meta, handle, indent=2)


# -- files ------------------------------------------------------------------------------------------


def upload_folder(local_dir: str | Path, target: Store) -> None:
    """Copy a local folder's files into ``target`` through fsspec, streamed in chunks."""
    fs, path = target.fs()
    fs.makedirs(path, exist_ok=True)
    for name in sorted(os.listdir(local_dir)):
        source = Path(local_dir) / name
        if source.is_dir():
            upload_folder(source, target.join(name))
            continue
        with open(source, "rb") as reader, fs.open(f"{path}/{name}", "wb") as writer:
            shutil.copyfileobj(reader, writer, _CHUNK)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols


@contextmanager
def staging_folder(target: Store) -> Iterator[str]:
    """A local folder whose files end up in ``target``: the folder itself when it is local (no second
    copy), else a temporary one uploaded when the block ends without an error."""
    fs, path = target.fs()
    if is_local(fs):
        fs.makedirs(path, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield tmp
        upload_folder(tmp, target)


@contextmanager
def downloaded(source: Store) -> Iterator[str]:
    """A local path holding the file at ``source`` (the file itself when it is already local)."""
    fs, path = source.fs()
    if not fs.exists(path):
        raise CheckpointError(f"{source.uri} does not exist.")
    if is_local(fs):
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, os.path.basename(path))
        with fs.open(path, "rb") as reader, open(local, "wb") as writer:
            shutil.copyfileobj(reader, writer, _CHUNK)
        yield local


def read_full_weights(checkpoint: Store, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A one-rank checkpoint's ``model.safetensors``: its tensors, and the tied names left out of it,
    each mapped to the name holding its data (see ``untied_state_dict``)."""
    with downloaded(checkpoint.join("model.safetensors")) as local:
        with safe_open(local, framework="pt") as handle:
            aliases = json.loads((handle.metadata() or {}).get("aliases", "{}"))
        return load_file(local, device=device), aliases


def save_object(obj: Any, target: Store) -> None:
    with target.open("wb") as handle:
        torch.save(obj, handle)


def load_object(source: Store) -> Any:
    with downloaded(source) as local:
        return torch.load(local, map_location="cpu", weights_only=True)


def write_json(data: Mapping[str, Any], target: Store) -> None:
    """Replaced whole: a run plan or a record read while it is written is the old one or the new one."""
    target.replace_text(json.dumps(data, indent=2, sort_keys=True))


def read_json(source: Store) -> dict[str, Any]:
    try:
        with source.open("r") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{source.uri} does not exist.") from None


def require_complete(checkpoint: Store) -> dict[str, Any]:
    """The train state of a complete checkpoint; a clear error for anything else."""
    uri = checkpoint.uri.rstrip("/")
    if not checkpoint.exists():
        raise CheckpointError(f"Checkpoint {uri} does not exist.")
    if not checkpoint.join(MARKER).exists():
        raise CheckpointError(
            f"Checkpoint {uri} is incomplete (no {MARKER} marker): its write was interrupted. "
            "Resume from an earlier one."
        )
    return read_json(checkpoint.join(TRAIN_STATE))


def untied_state_dict(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A model's tensors on CPU with each storage once (safetensors refuses shared storage such as
    tied embeddings), and the names left out, each mapped to the name that holds its data."""
    owners: dict[tuple[int, int, tuple[int, ...]], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in owners:
            aliases[name] = owners[key]
            continue
        owners[key] = name
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors, aliases
