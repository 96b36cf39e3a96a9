"""The training worker: a plain class that owns the policy, its optimizer and the PPO-style update.

It is used in-process by ``engine.run.local`` and wrapped as a Ray actor by the orchestration layer.
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

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
from trellis.engine.faults import spike_lr_if_asked
from trellis.engine.moe.routers import moe_shape
from trellis.engine.storage.store import Store
from trellis.engine.train import fsdp, worker_checkpoint
from trellis.engine.train.compile import compile_policy
from trellis.engine.train.idle_memory import IdleMemory
from trellis.engine.train.logprob_head import Policy, output_head
from trellis.engine.train.lora import PolicyAdapters, is_adapter_name
from trellis.engine.train.moe_routing import TrainerRouting
from trellis.engine.train.packing import MicroBatch, PackedBatch, pack, split_by_tokens, to_packed, to_padded
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
from trellis.engine.train.vision_batch import ImageTable, tower_output, with_vision
from trellis.engine.vision.models import policy_auto_class
from trellis.engine.vision.processor import VisionProcessor
from trellis.engine.weights.attestation import BucketSum

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


class TrainingWorker:
    def __init__(self, config: TrellisConfig, *, total_train_steps: int, pad_token_id: int) -> None:
        self.config = config
        self.device = resolve_device(config.train_worker.device)
        self.idle = IdleMemory(config, self.device)  # where the weights wait while the rollout runs
        worker = config.train_worker
        bf16 = self.device.type == "cuda" and worker.dtype in ("auto", "bfloat16")
        # Several trainer ranks (a process group started by the caller) always shard the model.
        self.rank, self.world = fsdp.rank_and_world()
        self._fsdp = worker.fsdp or self.world > 1
        # Parameters and AdamW states stay float32. On GPU the compute runs in bf16: through FSDP2's
        # mixed-precision policy, or else under autocast.
        self._autocast = bf16 and not self._fsdp
        self._temperature = config.rollout.temperature if config.rollout.temperature > 0 else 1.0
        # A LoRA policy's frozen base needs no float32 master copy where the compute is bf16 anyway.
        base_dtype = torch.bfloat16 if config.lora is not None and self._autocast else torch.float32
        self.model = policy_auto_class(config.load_from).from_pretrained(config.load_from, dtype=base_dtype).to(self.device)
        self.vision = VisionProcessor.of_model(config.load_from)  # None for a text-only policy
        if self.vision is not None and worker.freeze_vision:
            self.model.model.visual.requires_grad_(False)
        output_head(self.model)  # refuses models whose logits are not head(hidden state)
        self.adapters = (
            PolicyAdapters(self.model, config.lora, where=config.load_from, seed=config.seed) if config.lora is not None else None
        )
        self._set_up_computation(worker)
        self.model.config.use_cache = False
        # LoRA's reference policy is the model itself with its adapters off (``_reference_logprobs``).
        self._reference = self._build_reference(bf16) if config.loss.kl_coef > 0 and self.adapters is None else None
        self.routing = TrainerRouting(self.model, config, self.device)  # after the reference copy, which routes itself
        self.policy = self._policy(self.model)
        if self._fsdp:
            fsdp.shard(
                self.policy, self.model.get_decoder().layers, self.device, torch.bfloat16 if bf16 else None,
                shard_size=worker.hsdp_shard_size,
            )
        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            [param for param in self.model.parameters() if param.requires_grad],
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            foreach=self.device.type == "cpu",
            fused=self.device.type == "cuda",
        )
        total_optimizer_steps = total_train_steps * config.train_worker.optimizer_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, warmup=optim.warmup_steps, total=total_optimizer_steps, kind=optim.lr_scheduler, min_ratio=optim.min_lr_ratio),
        )
        self._pad_id = pad_token_id
        self.applied_step = 0
        self.lr_scale = 1.0  # on the configured lr: lowered by the stability guard's rollbacks, kept in checkpoints
        self.sent_checksums: tuple[BucketSum, ...] = ()  # of the last weights sent to the rollout (attested syncs)

    def _set_up_computation(self, worker: TrainWorkerConfig) -> None:
        """The layout, attention kernel, activation checkpointing and compilation the config asks for."""
        self._layout = choose_layout(worker, self.device)
        if worker.attention_kernel == "fa4" and (reason := fa4_unavailable(self.device)) is not None:
            raise SettingError(f"train_worker.attention_kernel: fa4 cannot run here: {reason}. Use attention_kernel: torch.")
        if self._layout == "packed":
            use_varlen_attention(self.model, worker.attention_kernel)
        if worker.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
            if self.adapters is not None:  # the frozen embeddings' output must carry grad into the checkpoints
                self.model.enable_input_require_grads()
        self.compiled, self._cuda_graphs = compile_policy(
            self.model, worker, device=self.device, layout=self._layout, fsdp=self._fsdp,
            lora=self.adapters is not None, moe=moe_shape(self.model) is not None, vision=self.vision is not None,
        )

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
        mini_batches = split_evenly(batch.sequences, self.config.train_worker.optimizer_steps)
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
        self.routing.start_fit()
        if needs_old:
            passes = [[self._old_pass(m, i < real) for i, m in enumerate(micro)] for micro, real in zip(micro_per_mini, real_counts)]
            old = [[logprobs for logprobs, _ in micro] for micro in passes]
            routes = [[route for _, route in micro] for micro in passes]
        ref = None
        if self.config.loss.kl_coef > 0:
            ref = [[self._reference_logprobs(m) for m in micro] for micro in micro_per_mini]
        for index, micro in enumerate(micro_per_mini):
            metrics = self._update(
                micro, real_counts[index], old[index] if old else None, ref[index] if ref else None,
                routes[index] if routes else None, first_pass=not needs_old,
            )
            result.mini_batch_metrics.append(metrics)
        result.metrics = average(result.mini_batch_metrics)
        mine = self._my_share(batch.sequences)
        result.metrics.update(self.routing.finish_fit(mine, reduce_over_ranks=self.world > 1))
        if self.device.type == "cuda":  # the rank that needed most; it sets how large a model fits
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            result.metrics["memory/train_peak_gib"] = fsdp.max_over_ranks([peak])[0]
            filled = sum(seq.num_tokens for seq in mine) / (max(1, sum(real_counts)) * self.config.train_worker.pack_max_length)
            if (awake := self.idle.fit_ended(filled)) is not None:  # all engines stayed awake through it, or none did
                result.metrics["memory/engine_awake"] = fsdp.min_over_ranks([awake])[0]
            torch.cuda.reset_peak_memory_stats(self.device)
        self.applied_step = step
        return result

    def _my_share(self, sequences: list[TrainSequence]) -> list[TrainSequence]:
        """This rank's part of a mini-batch: every rank gets the whole batch and keeps its share."""
        if self.world == 1:
            return sequences
        return [sequences[i] for i in split_by_tokens(sequences, self.world)[self.rank]]

    def _micro_batches(self, sequences: list[TrainSequence]) -> list[Layout]:
        layout = self._layout
        # The routers of an MoE policy must see each token once per forward, in one row order.
        # ... and a vision-language prompt's images are not part of the prefix the layout shares.
        if layout == "shared_prefix" and (not can_share(sequences) or self.routing.is_moe or self.vision is not None):
            layout = "padded"
        budget = self.config.train_worker.pack_max_length
        lay_out = LAYOUTS[layout]
        if layout == "packed" and self._cuda_graphs:
            lay_out = functools.partial(to_packed, row_length=budget)
        packs = pack(sequences, budget, fill={"shared_prefix": "in_order", "packed": "even"}.get(layout, "tightest"))
        batches = [lay_out(sequences, indices, self._pad_id) for indices in packs]
        if self.vision is not None:
            images = self._image_table(sequences)
            batches = [with_vision(batch, [sequences[i] for i in indices], images) for batch, indices in zip(batches, packs)]
        return [batch.to(self.device) for batch in batches]

    def _image_table(self, sequences: list[TrainSequence]) -> ImageTable:
        """The sequences' images, each processed once; a frozen tower's output computed ahead, in calls of
        at most the patches one micro-batch could hold. (Under FSDP the tower's weights are whole only
        inside the policy's forward: there it runs with each micro-batch.)"""
        table = ImageTable(sequences, self.vision)
        if table.keys and self.config.train_worker.freeze_vision and not self._fsdp:
            merge = self.vision.merge_size**2
            with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
                table.compute_features(
                    lambda inputs: tower_output(self.model.model, inputs.pixel_values.to(self.device), inputs.image_grid_thw.to(self.device)),
                    max_patches=self.config.train_worker.pack_max_length * merge,
                )
        return table

    def _policy(self, model: torch.nn.Module) -> Policy:
        worker = self.config.train_worker
        return Policy(
            model, temperature=self._temperature, chunk_tokens=worker.logprob_chunk_tokens, keep_logits=worker.logprob_keep_logits
        )

    def _token_logprobs(self, policy: Policy, batch: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cuda_graphs:
            # Each micro-batch is a new iteration of the graphs: the previous one's outputs (its
            # forward's, or a backward's that has run) may be overwritten.
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
            return policy(batch)

    def _update(
        self, micro: list[Layout], real: int, old: list[torch.Tensor] | None, ref: list[torch.Tensor] | None,
        routes: list[torch.Tensor | None] | None = None, first_pass: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over ``micro``, of which the first ``real`` are this rank's share (the rest
        only keep the ranks in step). The loss is normalised by the tokens (or sequences) of every
        rank, so that N ranks make the update one rank would."""
        loss_config = self.config.loss
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
        reduce = dict(mode=loss_config.aggregation, total_tokens=total_tokens, total_sequences=total_sequences,
                      norm_length=float(loss_config.norm_length or self.config.rollout.max_new_tokens))
        for index, batch in enumerate(micro):
            record = tally if index < real else Tally()  # a filler's metrics are not this rank's
            with self.routing.session(batch, routes[index] if routes else None) as session:
                loss = self._micro_loss(batch, old[index] if old is not None else None, ref[index] if ref is not None else None,
                                        record, reduce, session)
                # FSDP averages the ranks' gradients; the loss is already normalised by every rank's tokens,
                # so the world size turns that average back into their sum.
                (loss * (self.world if index < real else 0.0)).backward()
            self.routing.observe(session, batch, agreement=first_pass and index < real, update=index < real)
        grad_norm = fsdp.to_plain(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.max_grad_norm))
        lr = self.optimizer.param_groups[0]["lr"]  # the scheduler's, or the run's own after a checkpoint load
        spike_lr_if_asked(self.optimizer.param_groups)  # a test's injected instability (engine.faults)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("Non-finite grad norm %s: this mini-batch's update is skipped.", float(grad_norm))
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return mini_batch_metrics(*tally.values(reduce_over_ranks=self.world > 1), total_tokens, float(grad_norm), lr)

    def _micro_loss(
        self, batch: Layout, old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, record: Tally,
        reduce: dict[str, Any], session,
    ) -> torch.Tensor:
        """One micro-batch's share of the mini-batch loss (its forward pass included)."""
        loss_config = self.config.loss
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
        if (aux := self.routing.aux_loss(session, batch, reduce["total_tokens"])) is not None:
            loss = loss + aux
            record.add("router/aux_loss", aux)
        record_token_stats(record, counts, entropy, old_logprobs.detach(), batch.rollout_logprobs_NL, mask)
        return loss

    @torch.no_grad()
    def _old_pass(self, batch: Layout, mine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Old-policy logprobs; with r2 also the experts the trainer routed each token to."""
        with self.routing.session(batch) as session:
            logprobs = self._token_logprobs(self.policy, batch)[0]
        self.routing.observe(session, batch, agreement=mine, update=False)
        return logprobs, self.routing.own_route(session)

    @torch.no_grad()
    def _logprobs_no_grad(self, policy: Policy, batch: Layout) -> torch.Tensor:
        return self._token_logprobs(policy, batch)[0]

    def _reference_logprobs(self, batch: Layout) -> torch.Tensor:
        if self.adapters is None:
            return self._logprobs_no_grad(self._reference, batch)
        with self.adapters.switched_off():
            return self._logprobs_no_grad(self.policy, batch)

    def _build_reference(self, bf16: bool) -> Policy:
        """The initial policy, frozen, for the KL penalty; kept in bf16 when the compute is bf16."""
        reference = copy.deepcopy(self.model).eval()
        reference.requires_grad_(False)
        if bf16 and self._fsdp:
            reference.to(torch.bfloat16)
        return self._policy(reference)

    # -- weights ----------------------------------------------------------------------------------

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full weights by the base model's names (detached views; the receiver copies them), sharded or
        not: for a full sync and weight checks. A LoRA policy's come merged."""
        weights = fsdp.full_tensors(self.model.state_dict())
        return self.adapters.merged(weights) if self.adapters is not None else weights

    @torch.no_grad()
    def canary_logprobs(self, token_ids: list[int]) -> list[float]:
        """The logprob of each token after the first given those before it, at temperature 1, under the
        current weights: the trainer's side of a weight attestation's canary (every rank calls it)."""
        zeros = [0.0] * (len(token_ids) - 1)
        (batch,) = self._micro_batches([TrainSequence(token_ids[:-1], token_ids[1:], zeros, zeros)])
        self.model.eval()  # fit sets train mode again
        # Eager even where compiled: this short no-grad forward would compile graphs used for nothing else.
        with self.policy.at_temperature(1.0), self.routing.session(batch), torch.compiler.set_stance("force_eager"):
            logprobs = self._token_logprobs(self.policy, batch)[0]
        return logprobs.flatten().index_select(0, batch.label_index_K).tolist()

    def export_adapter(self) -> dict[str, torch.Tensor]:
        """A LoRA policy's adapters alone, by the base's module names (``engine.weights.lora``); every
        rank calls it (gathering shards is collective)."""
        state = self.model.state_dict()
        return self.adapters.sync_payload(fsdp.full_tensors({k: v for k, v in state.items() if is_adapter_name(k)}))

    # -- checkpoints (engine.train.worker_checkpoint) ------------------------------------------------

    def save_checkpoint(self, checkpoint: Store, *, save_optimizer: bool) -> None:
        worker_checkpoint.save_checkpoint(self, checkpoint, save_optimizer=save_optimizer)

    def load_checkpoint(self, checkpoint: Store, *, load_optimizer: bool = True, load_scheduler: bool = True) -> int:
        return worker_checkpoint.load_checkpoint(self, checkpoint, load_optimizer=load_optimizer, load_scheduler=load_scheduler)

    def export_hf(self, target: Store, tokenizer_source: str) -> None:
        worker_checkpoint.export_hf(self, target, tokenizer_source)

    def offload(self) -> None:
        """The colocated hand-over to the rollout (``engine.train.idle_memory``): the last fit's cached memory
        goes back to the GPU, and the weights and optimizer state to CPU where ``offload_when_idle`` says."""
        self.idle.offload(self.policy, self.optimizer)

    def onload(self) -> None:
        self.idle.onload(self.policy, self.optimizer)

    def engine_may_stay_awake(self) -> bool:
        return self.idle.engine_may_stay_awake()


def choose_layout(worker: TrainWorkerConfig, device: torch.device) -> str:
    if worker.layout != "auto":
        return worker.layout
    if device.type == "cuda":
        return "packed"
    return "padded" if worker.gradient_checkpointing else "shared_prefix"
