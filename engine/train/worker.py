"""The training worker: a plain class that owns the policy, its optimizer and the PPO-style update.

It is used in-process by ``engine.run.local`` and wrapped as a Ray actor by the orchestration layer.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.engine.algo.losses import (
    aggregate,
    policy_objective,
    rollout_is_weights,
)
from trellis.engine.compat import enable_activation_checkpointing
from trellis.engine.config import TrainWorkerConfig, TrellisConfig
from trellis.engine.data.prepare import PreparedBatch, TrainSequence
from trellis.engine.devices import resolve_device
from trellis.engine.errors import SettingError
from trellis.engine.rng import capture_rng, restore_rng
from trellis.engine.storage.checkpoints import (
    CheckpointError,
    load_object,
    read_full_weights,
    save_object,
    staging_folder,
    untied_state_dict,
)
from trellis.engine.storage.store import Store
from trellis.engine.train import fsdp
from trellis.engine.train.compile import compile_decoder
from trellis.engine.train.logprob_head import Policy, output_head
from trellis.engine.train.moe_routing import TrainerRouting
from trellis.engine.train.packing import MicroBatch, PackedBatch, pack, split_by_tokens, to_packed, to_padded
from trellis.engine.train.sharded_checkpoint import is_sharded, load_sharded, save_sharded
from trellis.engine.train.shared_prefix import SharedPrefixBatch, can_share, to_shared_prefix
from trellis.engine.train.tally import (
    Tally,
    average,
    lr_factor,
    mini_batch_metrics,
    record_token_stats,
    split_evenly,
)
from trellis.engine.train.varlen_attention import fa4_unavailable, use_varlen_attention

logger = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What one ``fit`` reports: per-mini-batch metrics and step-level averages."""

    step: int
    mini_batch_metrics: list[dict[str, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


_NO_OPTIMIZER = (
    "{uri} holds no optimizer state (saved with checkpoint_no_save_optimizer); set "
    "load_checkpoint_cfg.load_optimizer_states=false to start with fresh AdamW moments."
)

Layout = MicroBatch | PackedBatch | SharedPrefixBatch
LAYOUTS = {"packed": to_packed, "padded": to_padded, "shared_prefix": to_shared_prefix}


class StepAlreadyApplied(RuntimeError):
    """``fit`` was called again for a step whose update is already in the weights."""


class TrainingWorker:
    def __init__(self, config: TrellisConfig, *, total_train_steps: int, pad_token_id: int) -> None:
        self._config = config
        self._device = resolve_device(config.train_worker.device)
        worker = config.train_worker
        bf16 = self._device.type == "cuda" and worker.dtype in ("auto", "bfloat16")
        # Several trainer ranks (a process group started by the caller) always shard the model.
        self._rank, self._world = fsdp.rank_and_world()
        self._fsdp = worker.fsdp or self._world > 1
        # Parameters and AdamW states stay float32. On GPU the compute runs in bf16: through FSDP2's
        # mixed-precision policy, or else under autocast.
        self._autocast = bf16 and not self._fsdp
        self._temperature = config.rollout.temperature if config.rollout.temperature > 0 else 1.0
        self.model = AutoModelForCausalLM.from_pretrained(config.load_from, dtype=torch.float32).to(self._device)
        output_head(self.model)  # refuses models whose logits are not head(hidden state)
        self._layout = choose_layout(worker, self._device)
        if worker.attention_kernel == "fa4" and (reason := fa4_unavailable(self._device)) is not None:
            raise SettingError(f"train_worker.attention_kernel: fa4 cannot run here: {reason}. Use attention_kernel: torch.")
        if self._layout == "packed":
            use_varlen_attention(self.model, worker.attention_kernel)
        if worker.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        self._cuda_graphs = worker.cuda_graphs and self._device.type == "cuda"
        if worker.cuda_graphs and not self._cuda_graphs:
            logger.warning("train_worker.cuda_graphs has no effect on %s; the decoder is compiled without them.", self._device)
        if worker.compile:
            compile_decoder(self.model, worker.compile_scope, cuda_graphs=self._cuda_graphs)
        self.model.config.use_cache = False
        self._reference = self._build_reference(bf16) if config.loss.kl_coef > 0 else None
        self._routing = TrainerRouting(self.model, config, self._device)  # after the reference copy, which routes itself
        self.policy = self._policy(self.model)
        if self._fsdp:
            fsdp.shard(
                self.policy, self.model.get_decoder().layers, self._device, torch.bfloat16 if bf16 else None,
                shard_size=worker.hsdp_shard_size,
            )
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
        mini_batches = split_evenly(batch.sequences, self._config.train_worker.optimizer_steps)
        # With one mini-batch the policy is still the rollout-time policy when the loss is taken, so
        # the "old" logprobs are the current ones detached and need no extra forward pass.
        needs_old = len(mini_batches) > 1
        micro_per_mini = [self._micro_batches(self._my_share(seqs)) for seqs in mini_batches]
        # Every rank runs as many micro-batches per mini-batch (each forward and backward takes part
        # in FSDP's collectives): a rank with fewer repeats a micro-batch of the mini-batch, weighted 0.
        real_counts = [len(micro) for micro in micro_per_mini]
        for seqs, micro, count in zip(mini_batches, micro_per_mini, fsdp.max_over_ranks(real_counts)):
            filler = micro[0] if micro else self._micro_batches(seqs[:1])[0]
            micro.extend([filler] * (int(count) - len(micro)))
        # Old and reference logprobs are taken for the whole batch before the first update; with r2
        # the old pass's routing is kept for the update.
        old, routes = None, None
        self._routing.start_fit()
        if needs_old:
            passes = [[self._old_pass(m, i < real) for i, m in enumerate(micro)] for micro, real in zip(micro_per_mini, real_counts)]
            old = [[logprobs for logprobs, _ in micro] for micro in passes]
            routes = [[route for _, route in micro] for micro in passes]
        ref = None
        if self._reference is not None:
            ref = [[self._logprobs_no_grad(self._reference, m) for m in micro] for micro in micro_per_mini]
        for index, micro in enumerate(micro_per_mini):
            metrics = self._update(
                micro, real_counts[index], old[index] if old else None, ref[index] if ref else None,
                routes[index] if routes else None, first_pass=not needs_old,
            )
            result.mini_batch_metrics.append(metrics)
        result.metrics = average(result.mini_batch_metrics)
        result.metrics.update(self._routing.finish_fit(self._my_share(batch.sequences), reduce_over_ranks=self._world > 1))
        if self._device.type == "cuda":  # the rank that needed most; it sets how large a model fits
            peak = torch.cuda.max_memory_allocated(self._device) / 2**30
            result.metrics["memory/train_peak_gib"] = fsdp.max_over_ranks([peak])[0]
            torch.cuda.reset_peak_memory_stats(self._device)
        self.applied_step = step
        return result

    def _my_share(self, sequences: list[TrainSequence]) -> list[TrainSequence]:
        """This rank's part of a mini-batch: every rank gets the whole batch and keeps its share."""
        if self._world == 1:
            return sequences
        return [sequences[i] for i in split_by_tokens(sequences, self._world)[self._rank]]

    def _micro_batches(self, sequences: list[TrainSequence]) -> list[Layout]:
        layout = self._layout
        # The routers of an MoE policy must see each token once per forward, in one row order.
        if layout == "shared_prefix" and (not can_share(sequences) or self._routing.is_moe):
            layout = "padded"
        budget = self._config.train_worker.pack_max_length
        lay_out = LAYOUTS[layout]
        if layout == "packed" and self._cuda_graphs:
            lay_out = functools.partial(to_packed, row_length=budget)
        packs = pack(sequences, budget, keep_order=layout == "shared_prefix")
        return [lay_out(sequences, indices, self._pad_id).to(self._device) for indices in packs]

    def _policy(self, model: torch.nn.Module) -> Policy:
        worker = self._config.train_worker
        return Policy(
            model, temperature=self._temperature, chunk_tokens=worker.logprob_chunk_tokens, keep_logits=worker.logprob_keep_logits
        )

    def _token_logprobs(self, policy: Policy, batch: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cuda_graphs:
            # Each micro-batch is a new iteration of the graphs: the previous one's outputs (its
            # forward's, or a backward's that has run) may be overwritten.
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self._device.type, dtype=torch.bfloat16, enabled=self._autocast):
            return policy(batch)

    def _update(
        self, micro: list[Layout], real: int, old: list[torch.Tensor] | None, ref: list[torch.Tensor] | None,
        routes: list[torch.Tensor | None] | None = None, first_pass: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over ``micro``, of which the first ``real`` are this rank's share (the rest
        only keep the ranks in step). The loss is normalised by the tokens (or sequences) of every
        rank, so that N ranks make the update one rank would."""
        loss_config = self._config.loss
        total_tokens, total_sequences = fsdp.sum_over_ranks(
            [float(sum(m.label_index_K.numel() for m in micro[:real])), float(sum(m.num_sequences for m in micro[:real]))]
        )
        tally = Tally()
        if self._cuda_graphs:
            # The first backward would keep its gradients as .grad, in memory its graph overwrites when
            # it replays for the next micro-batch; into buffers of their own they are added instead.
            for param in self.model.parameters():
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
        reduce = dict(mode=loss_config.aggregation, total_tokens=total_tokens, total_sequences=total_sequences)
        for index, batch in enumerate(micro):
            record = tally if index < real else Tally()  # a filler's metrics are not this rank's
            with self._routing.session(batch, routes[index] if routes else None) as session:
                loss = self._micro_loss(batch, old[index] if old is not None else None, ref[index] if ref is not None else None,
                                        record, reduce, session)
                # FSDP averages the ranks' gradients; the loss is already normalised by every rank's tokens,
                # so the world size turns that average back into their sum.
                (loss * (self._world if index < real else 0.0)).backward()
            self._routing.observe(session, batch, agreement=first_pass and index < real, update=index < real)
        grad_norm = fsdp.to_plain(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._config.optim.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("Non-finite grad norm %s: this mini-batch's update is skipped.", float(grad_norm))
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return mini_batch_metrics(*tally.values(reduce_over_ranks=self._world > 1), total_tokens, float(grad_norm), lr)

    def _micro_loss(
        self, batch: Layout, old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, record: Tally,
        reduce: dict[str, Any], session,
    ) -> torch.Tensor:
        """One micro-batch's share of the mini-batch loss (its forward pass included)."""
        loss_config = self._config.loss
        mask = batch.loss_mask_NL
        logprobs, entropy = self._token_logprobs(self.policy, batch)
        old_logprobs = old_logprobs if old_logprobs is not None else logprobs.detach()
        is_weights = None
        if loss_config.rollout_is.level != "none":
            is_weights, is_stats = rollout_is_weights(old_logprobs, batch.rollout_logprobs_NL, mask, loss_config.rollout_is)
            record.add("rollout_is/weight_sum", is_stats["weight_sum"])
            record.add("rollout_is/rejected", is_stats["rejected"])
            record.max("rollout_is/max", is_stats["weight_max"])
            record.min("rollout_is/min", is_stats["weight_min"])
        pg_loss, kl, counts = policy_objective(
            logprobs, old_logprobs, batch.advantages_NL, mask, loss_config, is_weights_NL=is_weights, ref_logprobs_NL=ref_logprobs
        )
        loss = aggregate(pg_loss, mask, **reduce)
        record.add("pg_loss", loss)
        if kl is not None:
            kl_loss = aggregate(kl, mask, **reduce)
            loss = loss + loss_config.kl_coef * kl_loss
            record.add("kl", kl_loss)
        if (aux := self._routing.aux_loss(session, batch, reduce["total_tokens"])) is not None:
            loss = loss + aux
            record.add("router/aux_loss", aux)
        record_token_stats(record, counts, entropy, old_logprobs.detach(), batch.rollout_logprobs_NL, mask)
        return loss

    @torch.no_grad()
    def _old_pass(self, batch: Layout, mine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Old-policy logprobs; with r2 also the experts the trainer routed each token to."""
        with self._routing.session(batch) as session:
            logprobs = self._token_logprobs(self.policy, batch)[0]
        self._routing.observe(session, batch, agreement=mine, update=False)
        return logprobs, self._routing.own_route(session)

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

    def save_checkpoint(self, checkpoint: Store, *, save_optimizer: bool) -> None:
        """Write this worker's part of a checkpoint: weights, optimizer, scheduler, step and RNG states.
        Several ranks write a distributed checkpoint (each rank its shards) that loads at any world
        size; one rank writes full tensors (``model.safetensors``), which load at any world size too."""
        state = {"applied_step": self.applied_step, "scheduler": self.scheduler.state_dict(), "rng": capture_rng(),
                 "moe": self._routing.checkpoint_entry()}
        if self._world > 1:
            save_sharded(checkpoint, self.model, self.optimizer if save_optimizer else None)
            name = "trainer.pt" if self._rank == 0 else f"trainer-rank{self._rank}.pt"
            save_object(state, checkpoint.join(name))
            return
        tensors, aliases = untied_state_dict(self.export_weights())
        with staging_folder(checkpoint) as folder:
            save_file(tensors, f"{folder}/model.safetensors", metadata={"aliases": json.dumps(aliases)})
            if save_optimizer:
                torch.save(fsdp.optimizer_state(self.model, self.optimizer), f"{folder}/optimizer.pt")
            torch.save(state, f"{folder}/trainer.pt")

    def load_checkpoint(self, checkpoint: Store, *, load_optimizer: bool = True) -> int:
        """Restore what ``save_checkpoint`` wrote, at this run's world size; returns the checkpoint's step."""
        uri = checkpoint.uri.rstrip("/")
        state = load_object(checkpoint.join("trainer.pt"))
        if (problem := self._routing.load_problem(uri, state)) is not None:
            raise CheckpointError(problem)
        if is_sharded(checkpoint):
            if load_optimizer and not checkpoint.join("optim").exists():
                raise CheckpointError(_NO_OPTIMIZER.format(uri=uri))
            load_sharded(checkpoint, self.model, self.optimizer if load_optimizer else None)
        else:
            self._load_full_weights(checkpoint)
            if load_optimizer:
                if not checkpoint.join("optimizer.pt").exists():
                    raise CheckpointError(_NO_OPTIMIZER.format(uri=uri))
                fsdp.load_optimizer_state(self.model, self.optimizer, load_object(checkpoint.join("optimizer.pt")))
        if not load_optimizer:
            self.optimizer.state.clear()
        self.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        rank_state = checkpoint.join(f"trainer-rank{self._rank}.pt")  # absent when the checkpoint had fewer ranks
        restore_rng((load_object(rank_state) if self._rank and rank_state.exists() else state)["rng"])
        self.applied_step = int(state["applied_step"])
        return self.applied_step

    def _load_full_weights(self, checkpoint: Store) -> None:
        tensors, aliases = read_full_weights(checkpoint, device=str(self._device))
        missing, unexpected = fsdp.load_model_state(self.model, tensors)
        if not set(missing) <= set(aliases) or unexpected:  # tied names load through the name that owns their data
            raise CheckpointError(f"{checkpoint.uri} does not match the model: missing {missing}, unexpected {unexpected}.")

    def export_hf(self, target: Store, tokenizer_source: str) -> None:
        """``save_pretrained`` model and tokenizer: loads with ``AutoModelForCausalLM.from_pretrained``."""
        weights = self.export_weights()  # every rank takes part in gathering the full tensors
        if self._rank != 0:
            return
        with staging_folder(target) as folder:
            self.model.save_pretrained(folder, state_dict=weights, safe_serialization=True)
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


def choose_layout(worker: TrainWorkerConfig, device: torch.device) -> str:
    if worker.layout != "auto":
        return worker.layout
    if device.type == "cuda":
        return "packed"
    return "padded" if worker.gradient_checkpointing else "shared_prefix"
