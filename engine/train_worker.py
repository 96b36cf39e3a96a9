"""The training worker: a plain class that owns the policy, its optimizer and the PPO-style update.

It is used in-process by ``engine.local_run`` and wrapped as a Ray actor by the orchestration layer.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.checkpoint import (
    CheckpointError,
    downloaded,
    exists,
    load_object,
    staging_folder,
    untied_state_dict,
)
from engine import fsdp
from engine.config import TrainWorkerConfig, TrellisConfig
from engine.logprob_head import Policy, output_head
from engine.losses import aggregate, mismatch_sums, policy_objective, rollout_is_weights
from engine.packing import MicroBatch, PackedBatch, pack, to_packed, to_padded
from engine.prepare import PreparedBatch, TrainSequence
from engine.rng import capture_rng, restore_rng
from engine.shared_prefix import SharedPrefixBatch, can_share, to_shared_prefix
from engine.varlen_attention import use_varlen_attention

logger = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What one ``fit`` reports: per-mini-batch metrics and step-level averages."""

    step: int
    mini_batch_metrics: list[dict[str, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


Layout = MicroBatch | PackedBatch | SharedPrefixBatch
LAYOUTS = {"packed": to_packed, "padded": to_padded, "shared_prefix": to_shared_prefix}


class StepAlreadyApplied(RuntimeError):
    """``fit`` was called again for a step whose update is already in the weights."""


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def lr_factor(step: int, *, warmup: int, total: int, kind: str, min_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


class TrainingWorker:
    def __init__(self, config: TrellisConfig, *, total_train_steps: int, pad_token_id: int) -> None:
        self._config = config
        self._device = resolve_device(config.train_worker.device)
        worker = config.train_worker
        bf16 = self._device.type == "cuda" and worker.dtype in ("auto", "bfloat16")
        self._fsdp = worker.fsdp
        # Parameters and AdamW states stay float32. On GPU the compute runs in bf16: through FSDP2's
        # mixed-precision policy, or else under autocast.
        self._autocast = bf16 and not self._fsdp
        self._temperature = config.rollout.temperature if config.rollout.temperature > 0 else 1.0
        self.model = AutoModelForCausalLM.from_pretrained(config.load_from, dtype=torch.float32).to(self._device)
        output_head(self.model)  # refuses models whose logits are not head(hidden state)
        self._layout = choose_layout(worker, self._device)
        if self._layout == "packed":
            use_varlen_attention(self.model)
        if worker.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        self._cuda_graphs = worker.cuda_graphs and self._device.type == "cuda"
        if worker.cuda_graphs and not self._cuda_graphs:
            logger.warning("train_worker.cuda_graphs has no effect on %s; the decoder is compiled without them.", self._device)
        if worker.compile:
            compile_decoder(self.model, worker.compile_scope, cuda_graphs=self._cuda_graphs)
        self.model.config.use_cache = False
        self._reference = self._build_reference(bf16) if config.loss.kl_coef > 0 else None
        self.policy = self._policy(self.model)
        if self._fsdp:
            fsdp.shard(self.policy, self.model.get_decoder().layers, self._device, torch.bfloat16 if bf16 else None)
        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            foreach=self._device.type == "cpu",
            fused=self._device.type == "cuda",
        )
        total_optimizer_steps = total_train_steps * config.train_worker.optimizer_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(
                s, warmup=optim.warmup_steps, total=total_optimizer_steps, kind=optim.lr_scheduler, min_ratio=optim.min_lr_ratio
            ),
        )
        self._pad_id = pad_token_id
        self.applied_step = 0

    # -- the update ---------------------------------------------------------------------------------

    def fit(self, batch: PreparedBatch, step: int) -> FitResult:
        """Apply one rollout batch as ``optimizer_steps`` PPO mini-batch updates."""
        if step <= self.applied_step:
            raise StepAlreadyApplied(f"Step {step} is already applied (weights are at step {self.applied_step}).")
        result = FitResult(step=step)
        if not batch.sequences:
            logger.warning("Step %d has no valid training sequences; the weights are left unchanged.", step)
            self.applied_step = step
            return result
        self.model.train()
        mini_batches = _split(batch.sequences, self._config.train_worker.optimizer_steps)
        # With one mini-batch the policy is still the rollout-time policy when the loss is taken, so
        # the "old" logprobs are the current ones detached and need no extra forward pass.
        needs_old = len(mini_batches) > 1
        micro_per_mini = [self._micro_batches(seqs) for seqs in mini_batches]
        # Old and reference logprobs are taken for the whole batch before the first update.
        old = [[self._logprobs_no_grad(self.policy, m) for m in micro] for micro in micro_per_mini] if needs_old else None
        ref = None
        if self._reference is not None:
            ref = [[self._logprobs_no_grad(self._reference, m) for m in micro] for micro in micro_per_mini]
        for index, micro in enumerate(micro_per_mini):
            metrics = self._update(micro, old[index] if old else None, ref[index] if ref else None)
            result.mini_batch_metrics.append(metrics)
        result.metrics = _average(result.mini_batch_metrics)
        self.applied_step = step
        return result

    def _micro_batches(self, sequences: list[TrainSequence]) -> list[Layout]:
        layout = self._layout
        if layout == "shared_prefix" and not can_share(sequences):
            layout = "padded"
        budget = self._config.train_worker.pack_max_length
        lay_out = LAYOUTS[layout]
        if layout == "packed" and self._cuda_graphs:
            lay_out = functools.partial(to_packed, row_length=budget)
        packs = pack(sequences, budget, keep_order=layout == "shared_prefix")
        return [lay_out(sequences, indices, self._pad_id).to(self._device) for indices in packs]

    def _policy(self, model: torch.nn.Module) -> Policy:
        return Policy(model, temperature=self._temperature, chunk_tokens=self._config.train_worker.logprob_chunk_tokens)

    def _token_logprobs(self, policy: Policy, batch: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cuda_graphs:
            # Each micro-batch is a new iteration of the graphs: the previous one's outputs (its
            # forward's, or a backward's that has run) may be overwritten.
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self._device.type, dtype=torch.bfloat16, enabled=self._autocast):
            return policy(batch)

    def _update(self, micro: list[Layout], old: list[torch.Tensor] | None, ref: list[torch.Tensor] | None) -> dict[str, float]:
        loss_config = self._config.loss
        total_tokens = float(sum(m.label_index_K.numel() for m in micro))
        total_sequences = float(sum(m.num_sequences for m in micro))
        tally = _Tally()
        if self._cuda_graphs:
            # The first backward would keep its gradients as .grad, in memory its graph overwrites when
            # it replays for the next micro-batch; into buffers of their own they are added instead.
            for param in self.model.parameters():
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
        for index, batch in enumerate(micro):
            mask = batch.loss_mask_NL
            logprobs, entropy = self._token_logprobs(self.policy, batch)
            old_logprobs = old[index] if old is not None else logprobs.detach()
            is_weights = None
            if loss_config.rollout_is.level != "none":
                is_weights, is_stats = rollout_is_weights(old_logprobs, batch.rollout_logprobs_NL, mask, loss_config.rollout_is)
                tally.add("rollout_is/weight_sum", is_stats["weight_sum"])
                tally.add("rollout_is/rejected", is_stats["rejected"])
                tally.max("rollout_is/max", is_stats["weight_max"])
                tally.min("rollout_is/min", is_stats["weight_min"])
            pg_loss, kl, counts = policy_objective(
                logprobs,
                old_logprobs,
                batch.advantages_NL,
                mask,
                loss_config,
                is_weights_NL=is_weights,
                ref_logprobs_NL=ref[index] if ref is not None else None,
            )
            reduce = dict(mode=loss_config.aggregation, total_tokens=total_tokens, total_sequences=total_sequences)
            loss = aggregate(pg_loss, mask, **reduce)
            tally.add("pg_loss", loss)
            if kl is not None:
                kl_loss = aggregate(kl, mask, **reduce)
                loss = loss + loss_config.kl_coef * kl_loss
                tally.add("kl", kl_loss)
            loss.backward()
            for name, value in counts.items():
                tally.add(name, value)
            tally.add("entropy_sum", entropy.sum())
            for name, value in mismatch_sums(old_logprobs.detach(), batch.rollout_logprobs_NL, mask).items():
                if name.endswith("_max"):
                    tally.max(f"mismatch/{name}", value)
                else:
                    tally.add(f"mismatch/{name}", value)
        grad_norm = fsdp.to_plain(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._config.optim.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("Non-finite grad norm %s: this mini-batch's update is skipped.", float(grad_norm))
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return _mini_batch_metrics(*tally.values(), total_tokens, float(grad_norm), lr)

    @torch.no_grad()
    def _logprobs_no_grad(self, policy: Policy, batch: Layout) -> torch.Tensor:
        return self._token_logprobs(policy, batch)[0]

    def _build_reference(self, bf16: bool) -> Policy:
        """The initial policy, frozen, for the KL penalty; kept in bf16 when the compute is bf16."""
        reference = copy.deepcopy(self.model).eval()
        reference.requires_grad_(False)
        if bf16 and self._fsdp:
            reference.to(torch.bfloat16)
        return self._policy(reference)

    # -- weights ----------------------------------------------------------------------------------

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full weights by name (detached views; the receiver copies them): for the rollout backend,
        checkpoints and HF exports alike, sharded or not."""
        return fsdp.full_tensors(self.model.state_dict())

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, uri: str, storage_options: Mapping[str, Any], *, save_optimizer: bool) -> None:
        """Write this worker's part of a checkpoint: weights, optimizer, scheduler, step and RNG states."""
        tensors, aliases = untied_state_dict(self.export_weights())
        with staging_folder(uri, storage_options) as folder:
            save_file(tensors, f"{folder}/model.safetensors", metadata={"aliases": json.dumps(aliases)})
            if save_optimizer:
                torch.save(fsdp.optimizer_state(self.model, self.optimizer), f"{folder}/optimizer.pt")
            state = {"applied_step": self.applied_step, "scheduler": self.scheduler.state_dict(), "rng": capture_rng()}
            torch.save(state, f"{folder}/trainer.pt")

    def load_checkpoint(self, uri: str, storage_options: Mapping[str, Any], *, load_optimizer: bool = True) -> int:
        """Restore what ``save_checkpoint`` wrote; returns the checkpoint's step."""
        uri = uri.rstrip("/")
        with downloaded(f"{uri}/model.safetensors", storage_options) as local:
            with safe_open(local, framework="pt") as handle:
                aliases = json.loads((handle.metadata() or {}).get("aliases", "{}"))
            missing, unexpected = fsdp.load_model_state(self.model, load_file(local, device=str(self._device)))
        if not set(missing) <= set(aliases) or unexpected:  # tied names load through the name that owns their data
            raise CheckpointError(f"{uri} does not match the model: missing {missing}, unexpected {unexpected}.")
        state = load_object(f"{uri}/trainer.pt", storage_options)
        self.scheduler.load_state_dict(state["scheduler"])
        if load_optimizer:
            if not exists(f"{uri}/optimizer.pt", storage_options):
                raise CheckpointError(
                    f"{uri} holds no optimizer state (saved with checkpoint_no_save_optimizer); set "
                    "load_checkpoint_cfg.load_optimizer_states=false to start with fresh AdamW moments."
                )
            fsdp.load_optimizer_state(self.model, self.optimizer, load_object(f"{uri}/optimizer.pt", storage_options))
        else:
            self.optimizer.state.clear()
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        restore_rng(state["rng"])
        self.applied_step = int(state["applied_step"])
        return self.applied_step

    def export_hf(self, uri: str, storage_options: Mapping[str, Any], tokenizer_source: str) -> None:
        """``save_pretrained`` model and tokenizer: loads with ``AutoModelForCausalLM.from_pretrained``."""
        with staging_folder(uri, storage_options) as folder:
            self.model.save_pretrained(folder, state_dict=self.export_weights(), safe_serialization=True)
            AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(folder)

    def offload(self) -> None:
        """Move parameters and optimizer state to CPU (a no-op on CPU, or with offload_when_idle off)."""
        if self._config.train_worker.offload_when_idle:
            self._move(torch.device("cpu"))

    def onload(self) -> None:
        self._move(self._device)

    def _move(self, device: torch.device) -> None:
        if self._device.type == "cpu":
            return
        self.policy.to(device)  # the FSDP root, which re-registers its sharded parameters after the move
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (transformers renamed the switch in v5.2x)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


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


def choose_layout(worker: TrainWorkerConfig, device: torch.device) -> str:
    if worker.layout != "auto":
        return worker.layout
    if device.type == "cuda":
        return "packed"
    return "padded" if worker.gradient_checkpointing else "shared_prefix"


class _Tally:
    """Metric sums, maxima and minima of a mini-batch, kept on the device until it ends so that the
    micro-batch loop never waits for the GPU (each ``float()`` of a GPU value would)."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._maxima: dict[str, torch.Tensor] = {}
        self._minima: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def max(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self._maxima[name] = torch.maximum(self._maxima[name], value) if name in self._maxima else value

    def min(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self._minima[name] = torch.minimum(self._minima[name], value) if name in self._minima else value

    def values(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """All three as floats, read back from the device at once."""
        tables = (self._sums, self._maxima, self._minima)
        out: tuple[dict[str, float], ...] = (defaultdict(float), {}, {})
        entries = [(which, name, value) for which, table in enumerate(tables) for name, value in table.items()]
        if entries:
            numbers = torch.stack([value for _, _, value in entries]).tolist()
            for (which, name, _), number in zip(entries, numbers):
                out[which][name] = number
        return out


def _split(sequences: list[TrainSequence], parts: int) -> list[list[TrainSequence]]:
    size = math.ceil(len(sequences) / parts)
    return [sequences[i : i + size] for i in range(0, len(sequences), size)]


def _mini_batch_metrics(sums, maxima, minima, tokens: float, grad_norm: float, lr: float) -> dict[str, float]:
    tokens = max(tokens, 1.0)
    metrics = {
        "pg_loss": sums["pg_loss"],
        "grad_norm": grad_norm,
        "lr": lr,
        "entropy": sums["entropy_sum"] / tokens,
        "clipfrac_low": sums["clipped_low"] / tokens,
        "clipfrac_high": sums["clipped_high"] / tokens,
        "clipfrac": (sums["clipped_low"] + sums["clipped_high"]) / tokens,
    }
    if "dual_clipped" in sums:
        metrics["dual_clipfrac"] = sums["dual_clipped"] / tokens
    if "kl" in sums:
        metrics["kl"] = sums["kl"]
    metrics["mismatch/k3_kl"] = sums["mismatch/k3_kl"] / tokens
    metrics["mismatch/abs_logprob_diff"] = sums["mismatch/abs_logprob_diff"] / tokens
    metrics["mismatch/abs_logprob_diff_max"] = maxima["mismatch/abs_logprob_diff_max"]
    metrics["mismatch/train_ppl"] = math.exp(sums["mismatch/train_nll"] / tokens)
    metrics["mismatch/rollout_ppl"] = math.exp(sums["mismatch/rollout_nll"] / tokens)
    metrics["entropy/rollout"] = sums["mismatch/rollout_nll"] / tokens  # sampled-token NLL estimates entropy
    if "rollout_is/weight_sum" in sums:
        metrics["rollout_is/mean"] = sums["rollout_is/weight_sum"] / tokens
        metrics["rollout_is/max"] = maxima["rollout_is/max"]
        metrics["rollout_is/min"] = minima["rollout_is/min"]
        metrics["rollout_is/rejected_fraction"] = sums["rollout_is/rejected"] / tokens
    return metrics


def _average(mini_batches: list[dict[str, float]]) -> dict[str, float]:
    keys = mini_batches[0].keys() if mini_batches else []
    return {key: sum(m[key] for m in mini_batches) / len(mini_batches) for key in keys}
