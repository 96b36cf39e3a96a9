"""Sharded checkpoints of a policy and its AdamW state: each rank writes only the shards it holds.

Layout of ``{folder}``, any fsspec URI (a local path, ``file://``, ``s3://``), in the format of
``torch.distributed.checkpoint`` (DCP):

    optim/   AdamW state keyed by parameter name (absent when saved without an optimizer)
    model/   weights keyed by parameter name; written last, so ``model/.metadata`` marks the
             folder complete

Loading reshards: a checkpoint saved by N ranks loads at any world size, into a model sharded with
``fully_shard`` or a plain one, and without any process group (DCP's no-dist mode) as well.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.api import CheckpointException
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import Metadata, TensorStorageMetadata

# Not re-exported by torch.distributed.checkpoint (torch 2.13); this module is where DCP keeps them.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trellis.engine.storage.checkpoints import CheckpointError
from trellis.engine.storage.store import Store

MODEL = "model"
OPTIM = "optim"
METADATA = ".metadata"  # DCP's own name; it renames it into place once every rank has written


def save_sharded(
    folder: Store, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, trainable_only: bool = False,
    validate: bool = True,
) -> None:
    """Write ``model`` (and ``optimizer``) under ``folder``, a new or empty folder such as
    ``SaveStore.begin`` returns. Every rank of the default process group calls this. ``trainable_only``:
    leave frozen weights out (a LoRA policy's base, which ``load_from`` holds). ``validate``: DCP checks
    that the shards of every tensor tile it exactly (``skip_checkpoint_validation`` turns it off)."""
    with nullcontext() if validate else _no_plan_validation():
        if optimizer is not None:
            _save(get_optimizer_state_dict(model, optimizer), folder.join(OPTIM))
        _save(_weights(model, trainable_only), folder.join(MODEL))


@contextmanager
def _no_plan_validation() -> Iterator[None]:
    """DCP's default planner without its global-plan check: the check is a module function of
    ``default_planner`` in torch 2.11-2.13, with no setting of its own."""
    checked = default_planner._validate_global_plan
    default_planner._validate_global_plan = lambda global_plan, metadata: []
    try:
        yield
    finally:
        default_planner._validate_global_plan = checked


def load_sharded(
    folder_store: Store, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, trainable_only: bool = False
) -> None:
    """Load a checkpoint written by ``save_sharded`` at any world size into ``model`` (and
    ``optimizer``), sharded or not. Every rank of the default process group, if any, calls this."""
    folder, options = folder_store.uri.rstrip("/"), folder_store.options
    if not is_sharded(folder_store):
        what = "does not exist" if not folder_store.exists() else f"holds no sharded checkpoint (no {MODEL}/{METADATA})"
        raise CheckpointError(f"{folder} {what}.")
    if optimizer is not None and not _exists(folder_store.join(OPTIM, METADATA)):
        raise CheckpointError(
            f"{folder} was saved without optimizer state; load it without an optimizer to start with fresh AdamW moments."
        )

    weights = _weights(model, trainable_only)
    reader = FsspecReader(f"{folder}/{MODEL}", **options)
    _check_weights(weights, reader.read_metadata(), f"{folder}/{MODEL}")
    _load(weights, reader, f"{folder}/{MODEL}")
    set_model_state_dict(model, weights, options=_options(trainable_only))
    if optimizer is None:
        return
    state = get_optimizer_state_dict(model, optimizer)  # creates AdamW's moments if no step ran yet
    reader = FsspecReader(f"{folder}/{OPTIM}", **options)
    stored = {path[1] for path in reader.read_metadata().planner_data.values() if path[0] == "state"}
    _check_names(set(state["state"]), stored, f"{folder}/{OPTIM}", "optimizer state")
    _load(state, reader, f"{folder}/{OPTIM}")
    set_optimizer_state_dict(model, optimizer, state)


def _options(trainable_only: bool) -> StateDictOptions:
    # strict=False with trainable_only: the frozen weights are absent on purpose.
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _weights(model: torch.nn.Module, trainable_only: bool) -> dict[str, Any]:
    weights = get_model_state_dict(model, options=_options(trainable_only))
    if trainable_only:  # DCP keeps a tied alias (lm_head.weight) of a frozen embedding: left out too
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        weights = {name: tensor for name, tensor in weights.items() if name in trainable}
    return weights


def is_sharded(folder: Store) -> bool:
    """Whether ``folder`` holds a complete checkpoint written by ``save_sharded``."""
    return _exists(folder.join(MODEL, METADATA))


def _save(state: dict[str, Any], target: Store) -> None:
    fs, _ = target.fs()
    # fsync is only possible on local files; on object stores DCP falls back to os.sync(), which
    # flushes every disk of the machine once per file.
    writer = FsspecWriter(target.uri, sync_files=isinstance(fs, LocalFileSystem), **target.options)
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException as error:  # a BaseException: every rank's failure in one, re-raised as an Exception
        raise CheckpointError(f"{target.uri} could not be saved: {error}") from error


def _load(state: dict[str, Any], reader: FsspecReader, uri: str) -> None:
    try:
        dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as error:  # DCP reports every rank's failure in one CheckpointException, a BaseException
        raise CheckpointError(f"{uri} could not be loaded: {error}") from error


def _check_weights(weights: Mapping[str, torch.Tensor], metadata: Metadata, uri: str) -> None:
    """Names and full shapes must match: DCP would skip a name the model lacks without a word."""
    stored = metadata.state_dict_metadata
    _check_names(set(weights), set(stored), uri, "weights")
    for name, tensor in weights.items():
        entry = stored[name]
        if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{uri} does not match the model: {name} is {list(entry.size)} there, {list(tensor.shape)} in the model."
            )


def _check_names(model_names: set[str], stored: set[str], uri: str, what: str) -> None:
    missing, unexpected = sorted(model_names - stored), sorted(stored - model_names)
    if missing or unexpected:
        raise CheckpointError(
            f"{uri} does not match the model's {what}: missing from the checkpoint {missing}, "
            f"not in the model {unexpected}."
        )


def _exists(target: Store) -> bool:
    fs, path = target.fs()
    fs.invalidate_cache(path)  # another process may have written it since this one last looked
    return fs.exists(path)
