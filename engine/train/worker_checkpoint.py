"""What a training worker writes and reads back: its checkpoints and its HF exports.

One rank writes full tensors (``model.safetensors``), several ranks a distributed checkpoint (each rank
its shards); both load at any world size. A LoRA policy's checkpoint holds its adapters alone
(``adapter.safetensors``, or the trainable tensors of the shards) with their optimizer state: the base is
``load_from``, which a resume reads again. Its HF export is a PEFT adapter folder, and on request the
merged model under ``merged/``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from trellis.engine.rng import capture_rng, restore_rng
from trellis.engine.storage.checkpoints import (
    CheckpointError,
    downloaded,
    load_object,
    read_full_weights,
    save_object,
    staging_folder,
    untied_state_dict,
)
from trellis.engine.storage.store import Store
from trellis.engine.train import fsdp
from trellis.engine.train.lora import load_adapters, peft_config, peft_folder_state
from trellis.engine.train.sharded_checkpoint import is_sharded, load_sharded, save_sharded

if TYPE_CHECKING:
    from trellis.engine.train.worker import TrainingWorker

ADAPTER_FILE = "adapter.safetensors"
_NO_OPTIMIZER = (
    "{uri} holds no optimizer state (saved with checkpoint_no_save_optimizer); set "
    "load_checkpoint_cfg.load_optimizer_states=false to start with fresh AdamW moments."
)


def save_checkpoint(worker: TrainingWorker, checkpoint: Store, *, save_optimizer: bool) -> None:
    """Weights (or adapters), optimizer, scheduler, step and RNG states of ``worker``'s rank."""
    lora = worker.config.lora
    state = {"applied_step": worker.applied_step, "scheduler": worker.scheduler.state_dict(), "rng": capture_rng(), "lr_scale": worker.lr_scale,
             "moe": worker.routing.checkpoint_entry(), "lora": lora.model_dump(mode="json") if lora else None}
    optimizer = worker.optimizer if save_optimizer else None
    if worker.world > 1:
        save_sharded(checkpoint, worker.model, optimizer, trainable_only=lora is not None,
                     validate=not worker.config.skip_checkpoint_validation)
        name = "trainer.pt" if worker.rank == 0 else f"trainer-rank{worker.rank}.pt"
        save_object(state, checkpoint.join(name))
        return
    weights = fsdp.full_tensors(worker.model.state_dict())
    with staging_folder(checkpoint) as folder:
        if worker.adapters is not None:
            tensors = {name: t.detach().cpu().contiguous() for name, t in worker.adapters.adapter_state(weights).items()}
            save_file(tensors, f"{folder}/{ADAPTER_FILE}")
        else:
            tensors, aliases = untied_state_dict(weights)
            save_file(tensors, f"{folder}/model.safetensors", metadata={"aliases": json.dumps(aliases)})
        if optimizer is not None:
            torch.save(fsdp.optimizer_state(worker.model, optimizer), f"{folder}/optimizer.pt")
        torch.save(state, f"{folder}/trainer.pt")


def load_checkpoint(worker: TrainingWorker, checkpoint: Store, *, load_optimizer: bool, load_scheduler: bool = True) -> int:
    """Restore what ``save_checkpoint`` wrote, at this run's world size; returns the checkpoint's step.
    ``load_scheduler`` False leaves the schedule at its first step."""
    uri = checkpoint.uri.rstrip("/")
    state = load_object(checkpoint.join("trainer.pt"))
    if (problem := worker.routing.load_problem(uri, state)) is not None:
        raise CheckpointError(problem)
    if (problem := _lora_problem(worker, uri, state.get("lora"))) is not None:
        raise CheckpointError(problem)
    lora = worker.adapters is not None
    if is_sharded(checkpoint):
        if load_optimizer and not checkpoint.join("optim").exists():
            raise CheckpointError(_NO_OPTIMIZER.format(uri=uri))
        load_sharded(checkpoint, worker.model, worker.optimizer if load_optimizer else None, trainable_only=lora)
    else:
        _load_adapters(worker, checkpoint) if lora else _load_full_weights(worker, checkpoint)
        if load_optimizer:
            if not checkpoint.join("optimizer.pt").exists():
                raise CheckpointError(_NO_OPTIMIZER.format(uri=uri))
            fsdp.load_optimizer_state(worker.model, worker.optimizer, load_object(checkpoint.join("optimizer.pt")))
    if not load_optimizer:
        worker.optimizer.state.clear()
    if load_scheduler:
        worker.scheduler.load_state_dict(state["scheduler"])
    worker.lr_scale = float(state.get("lr_scale", 1.0))
    apply_optim_settings(worker)
    rank_state = checkpoint.join(f"trainer-rank{worker.rank}.pt")  # absent when the checkpoint had fewer ranks
    restore_rng((load_object(rank_state) if worker.rank and rank_state.exists() else state)["rng"])
    worker.applied_step = int(state["applied_step"])
    return worker.applied_step


def apply_optim_settings(worker: TrainingWorker) -> None:
    """The checkpoint gives the schedule's position and AdamW's moments; the run's own settings give the
    hyperparameters (a loaded optimizer and scheduler would bring back the saved lr, betas and weight
    decay), so a resumed run, or a replay of a step, may change them. Unchanged settings give the same
    lr, computed as LambdaLR computes it; the stability guard's ``lr_scale`` multiplies it."""
    optim, scheduler = worker.config.optim, worker.scheduler
    base = optim.lr * worker.lr_scale
    scheduler.base_lrs = [base for _ in worker.optimizer.param_groups]
    for group, factor in zip(worker.optimizer.param_groups, scheduler.lr_lambdas):
        group.update(initial_lr=base, lr=base * factor(scheduler.last_epoch), betas=optim.betas, eps=optim.eps,
                     weight_decay=optim.weight_decay)


def _lora_problem(worker: TrainingWorker, uri: str, saved: dict | None) -> str | None:
    """A LoRA checkpoint resumes only a LoRA run of the same adapter shape, and a full one only a full one."""
    lora = worker.config.lora
    if saved is None and lora is None:
        return None
    if saved is None:
        return f"{uri} holds a full fine-tune's weights, not LoRA adapters; remove lora from the config to resume it."
    if lora is None:
        return f"{uri} holds LoRA adapters (rank {saved['rank']}); set lora as it was saved to resume it."
    shape = ("rank", "alpha", "target_modules")
    mine = lora.model_dump(mode="json")
    differ = [f"{key} {saved[key]} there, {mine[key]} here" for key in shape if saved.get(key) != mine[key]]
    return f"{uri} holds LoRA adapters of another shape: {'; '.join(differ)}." if differ else None


def _load_adapters(worker: TrainingWorker, checkpoint: Store) -> None:
    with downloaded(checkpoint.join(ADAPTER_FILE)) as local:
        tensors = load_file(local, device=str(worker.device))
    try:
        load_adapters(worker.model, tensors, checkpoint.uri)
    except ValueError as error:
        raise CheckpointError(str(error)) from error


def _load_full_weights(worker: TrainingWorker, checkpoint: Store) -> None:
    tensors, aliases = read_full_weights(checkpoint, device=str(worker.device))
    missing, unexpected = fsdp.load_model_state(worker.model, tensors)
    if not set(missing) <= set(aliases) or unexpected:  # tied names load through the name that owns their data
        raise CheckpointError(f"{checkpoint.uri} does not match the model: missing {missing}, unexpected {unexpected}.")


def export_hf(worker: TrainingWorker, target: Store, tokenizer_source: str) -> None:
    """``save_pretrained`` model, tokenizer and a VL policy's image processor (``from_pretrained`` loads it); a LoRA
    policy's is a PEFT adapter folder (``PeftModel.from_pretrained`` over load_from)."""
    weights = fsdp.full_tensors(worker.model.state_dict())  # every rank takes part in gathering the full tensors
    if worker.rank != 0:
        return
    lora = worker.config.lora
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    with staging_folder(target) as folder:
        if worker.adapters is None:
            worker.model.save_pretrained(folder, state_dict=weights, safe_serialization=True)
        else:
            adapters = {name: t.detach().cpu() for name, t in worker.adapters.adapter_state(weights).items()}
            save_file(peft_folder_state(adapters), f"{folder}/adapter_model.safetensors", metadata={"format": "pt"})
            config = peft_config(lora)
            config.base_model_name_or_path = worker.config.load_from
            config.save_pretrained(folder)
            if lora.export_merged:
                merged = {name: t.contiguous() for name, t in worker.adapters.merged(weights).items()}
                worker.model.save_pretrained(f"{folder}/merged", state_dict=merged, safe_serialization=True)
                tokenizer.save_pretrained(f"{folder}/merged")
                if worker.vision is not None:
                    worker.vision.save(f"{folder}/merged")
        tokenizer.save_pretrained(folder)
        if worker.vision is not None:
            worker.vision.save(folder)
