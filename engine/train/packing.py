"""Group training sequences into micro-batches of at most ``pack_max_length`` tokens, and lay them out.

Which sequences share a micro-batch is decided by the token budget (in order where the layout shares
prompts; otherwise as few micro-batches as first-fit decreasing fills: its own packs for padded rows,
the tokens spread evenly over them for packed ones). How the micro-batch is laid out for the model is
a separate choice:

- ``to_packed``: the sequences end to end in one row, attention kept inside each sequence
  (``engine.train.varlen_attention``). No pad token is computed; the layout for GPUs.
- ``to_padded``: right-padded rows, the plain layout every attention implementation runs.
- ``engine.train.shared_prefix``: each distinct prompt once, its KV cache shared by its group's samples.

Every layout keeps labels, advantages and rollout logprobs as right-padded [N, L] rows, which the
losses reduce per token or per sequence, and returns the hidden states of the K labelled positions
in row-major order of ``loss_mask_NL`` (``label_hidden``), at the precomputed ``label_index_K``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace
from typing import Literal, Self

import torch

from trellis.engine.data.prepare import IGNORE, TrainSequence
from trellis.engine.moe.replay_rows import replay_rows
from trellis.engine.train.vision_batch import VisionRows


class LabelRows:
    """What every layout shares: its labels as right-padded [N, L] rows."""

    labels_NL: torch.Tensor

    @property
    def loss_mask_NL(self) -> torch.Tensor:
        return self.labels_NL != IGNORE

    @property
    def num_sequences(self) -> int:
        return self.labels_NL.size(0)

    def to(self, device: torch.device) -> Self:
        """The same layout with every tensor on ``device`` (layouts are dataclasses)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        movable = (torch.Tensor, VisionRows)
        return replace(self, **{name: value.to(device) for name, value in values.items() if isinstance(value, movable)})


@dataclass
class MicroBatch(LabelRows):
    """Right-padded rows. N sequences, L = longest sequence."""

    input_ids_NL: torch.Tensor
    attention_mask_NL: torch.Tensor
    labels_NL: torch.Tensor
    advantages_NL: torch.Tensor
    rollout_logprobs_NL: torch.Tensor
    sequence_indices: list[int]  # positions of these sequences in the mini-batch
    label_index_K: torch.Tensor  # row-major positions of the K labels in [N, L]
    # MoE: recorded experts over the N x L token slots and where they apply (engine.moe.replay_rows)
    routed_experts_TLK: torch.Tensor | None = None
    routed_mask_T: torch.Tensor | None = None
    vision: VisionRows | None = None  # a vision-language policy's images and positions (engine.train.vision_batch)

    @property
    def tokens_T(self) -> torch.Tensor:
        """Which of the token slots the routers see are real tokens (not padding)."""
        return self.attention_mask_NL.flatten().bool()

    def label_hidden(self, decoder: torch.nn.Module) -> torch.Tensor:
        """Last hidden states of the labelled positions: [K, H]."""
        images = self.vision.model_inputs() if self.vision is not None else {}
        hidden_NLH = decoder(input_ids=self.input_ids_NL, attention_mask=self.attention_mask_NL, **images).last_hidden_state
        return hidden_NLH.flatten(0, 1).index_select(0, self.label_index_K)


def label_index(labels_NL: torch.Tensor) -> torch.Tensor:
    """Row-major positions of the trained labels, computed once on CPU so the GPU loop needs no sync."""
    return (labels_NL.flatten() != IGNORE).nonzero().squeeze(1)


Fill = Literal["in_order", "tightest", "even"]


def pack(sequences: list[TrainSequence], pack_max_length: int, *, fill: Fill = "in_order") -> list[list[int]]:
    """Indices of ``sequences`` per micro-batch, each holding at most ``pack_max_length`` tokens.

    fill:
    - ``in_order``: one micro-batch after another in the given order, so that a group's samples stay
      together (as ``shared_prefix`` needs);
    - ``tightest``: first-fit decreasing, longest first: fewer micro-batches than in order, and like
      lengths together, so padded rows carry little padding;
    - ``even``: first-fit decreasing's count of micro-batches, the tokens spread evenly over them, for
      packed rows (which hold no padding): no short last micro-batch, whose length a compiled decoder
      layer would recompile for (inductor guards its kernels on the length range it first saw; on an
      H100 a cold recompile cost 6-12 s).
    """
    for sequence in sequences:
        if sequence.num_tokens > pack_max_length:
            raise ValueError(
                f"A sequence of {sequence.num_tokens} tokens exceeds pack_max_length={pack_max_length}; "
                "raise train_worker.pack_max_length or lower max_prompt_length / max_new_tokens."
            )
    fills = {"in_order": _fill_in_order, "tightest": _first_fit_decreasing, "even": _even}
    return fills[fill](sequences, pack_max_length)


def split_by_tokens(sequences: list[TrainSequence], parts: int) -> list[list[int]]:
    """Indices of ``sequences`` for each of ``parts`` trainer ranks, balanced by token count.

    The samples of one prompt (consecutive sequences with the same shared prompt) stay on one rank, so
    that the ``shared_prefix`` layout still computes their prompt once. Longest units go first, each to
    the rank with the fewest tokens so far; each rank keeps its sequences in the given order.
    """
    units: list[list[int]] = []
    for index, sequence in enumerate(sequences):
        if units and _same_prompt(sequences[units[-1][0]], sequence):
            units[-1].append(index)
        else:
            units.append([index])
    shares: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for unit in sorted(units, key=lambda u: -sum(sequences[i].num_tokens for i in u)):
        target = loads.index(min(loads))
        shares[target].extend(unit)
        loads[target] += sum(sequences[i].num_tokens for i in unit)
    return [sorted(share) for share in shares]


def _same_prompt(first: TrainSequence, second: TrainSequence) -> bool:
    length = first.prompt_length
    return length > 0 and second.prompt_length == length and first.input_ids[:length] == second.input_ids[:length]


def _fill_in_order(sequences: list[TrainSequence], pack_max_length: int) -> list[list[int]]:
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, sequence in enumerate(sequences):
        if used + sequence.num_tokens > pack_max_length and current:
            packs.append(current)
            current, used = [], 0
        current.append(index)
        used += sequence.num_tokens
    if current:
        packs.append(current)
    return packs


def _first_fit_decreasing(sequences: list[TrainSequence], pack_max_length: int) -> list[list[int]]:
    packs: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(sequences)), key=lambda i: -sequences[i].num_tokens):
        need = sequences[index].num_tokens
        target = next((b for b, free in enumerate(room) if free >= need), None)
        if target is None:
            packs.append([])
            room.append(pack_max_length)
            target = len(packs) - 1
        packs[target].append(index)
        room[target] -= need
    return [sorted(indices) for indices in packs]


def _even(sequences: list[TrainSequence], pack_max_length: int) -> list[list[int]]:
    """First-fit decreasing's number of micro-batches, each sequence (longest first) going to the one
    with the fewest tokens so far; first-fit decreasing's own packs where that overflows one."""
    tight = _first_fit_decreasing(sequences, pack_max_length)
    packs: list[list[int]] = [[] for _ in tight]
    loads = [0] * len(tight)
    for index in sorted(range(len(sequences)), key=lambda i: -sequences[i].num_tokens):
        target = loads.index(min(loads))
        loads[target] += sequences[index].num_tokens
        if loads[target] > pack_max_length:  # the emptiest is too full: so is every other
            return tight
        packs[target].append(index)
    return [sorted(indices) for indices in packs]


def to_padded(sequences: list[TrainSequence], indices: list[int], pad_id: int) -> MicroBatch:
    chosen = [sequences[i] for i in indices]
    width = max(seq.num_tokens for seq in chosen)
    shape = (len(chosen), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, IGNORE, dtype=torch.long)
    advantages = torch.zeros(shape, dtype=torch.float32)
    rollout_logprobs = torch.zeros(shape, dtype=torch.float32)
    for row, seq in enumerate(chosen):
        n = seq.num_tokens
        input_ids[row, :n] = torch.tensor(seq.input_ids)
        attention[row, :n] = 1
        labels[row, :n] = torch.tensor(seq.labels)
        advantages[row, :n] = torch.tensor(seq.advantages)
        rollout_logprobs[row, :n] = torch.tensor(seq.rollout_logprobs)
    routed, routed_mask = replay_rows(chosen, [row * width for row in range(len(chosen))], len(chosen) * width)
    return MicroBatch(
        input_ids, attention, labels, advantages, rollout_logprobs, list(indices), label_index(labels), routed, routed_mask
    )


@dataclass
class PackedBatch(LabelRows):
    """One row of T tokens holding N sequences; ``cu_seq_lens`` [N + 1] marks where each starts (a row
    of fixed shape also holds a pad sequence and empty ones, see ``to_packed``)."""

    input_ids_1T: torch.Tensor
    position_ids_1T: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int
    label_positions_K: torch.Tensor  # where the K labels sit in the row
    labels_NL: torch.Tensor
    advantages_NL: torch.Tensor
    rollout_logprobs_NL: torch.Tensor
    sequence_indices: list[int]
    label_index_K: torch.Tensor
    routed_experts_TLK: torch.Tensor | None = None
    routed_mask_T: torch.Tensor | None = None
    real_tokens: int = 0  # the row's tokens before any fill
    vision: VisionRows | None = None

    @property
    def tokens_T(self) -> torch.Tensor:
        return torch.arange(self.input_ids_1T.size(1), device=self.input_ids_1T.device) < self.real_tokens

    def label_hidden(self, decoder: torch.nn.Module) -> torch.Tensor:
        images = self.vision.model_inputs() if self.vision is not None else {"position_ids": self.position_ids_1T}
        hidden_1TH = decoder(
            input_ids=self.input_ids_1T,
            **images,
            cu_seq_lens_q=self.cu_seq_lens,
            cu_seq_lens_k=self.cu_seq_lens,
            max_length_q=self.max_length,
            max_length_k=self.max_length,
        ).last_hidden_state
        # Sequences follow each other in the row, so the packed order of labelled positions is the
        # row-major order of the [N, L] labels.
        return hidden_1TH[0].index_select(0, self.label_positions_K)


def to_packed(sequences: list[TrainSequence], indices: list[int], pad_id: int, *, row_length: int | None = None) -> PackedBatch:
    """The sequences end to end in one row.

    row_length: give every micro-batch the same shapes, as CUDA graphs need. The row is filled up to
    ``row_length`` with one pad sequence that no label reads, ``cu_seq_lens`` grows to a power-of-two
    size with empty sequences (so a handful of sizes serve every micro-batch), and ``max_length`` is
    ``row_length``. The pad tokens are computed.
    """
    chosen = [sequences[i] for i in indices]
    lengths = [seq.num_tokens for seq in chosen]
    tokens = [token for seq in chosen for token in seq.input_ids]
    max_length = max(lengths)
    bounds = [0, *itertools.accumulate(lengths)]
    real_tokens = bounds[-1]
    routed, routed_mask = replay_rows(chosen, bounds[:-1], row_length or real_tokens)
    positions = [torch.arange(n) for n in lengths]
    if row_length is not None:
        fill = row_length - bounds[-1]
        if fill < 0:
            raise ValueError(f"{bounds[-1]} tokens do not fit a row of {row_length}.")
        if fill:
            tokens += [pad_id] * fill
            positions.append(torch.arange(fill))
            bounds.append(row_length)
        bounds += [row_length] * (_next_power_of_two(len(bounds)) - len(bounds))
        max_length = row_length
    padded = to_padded(sequences, indices, pad_id)
    labels = torch.tensor([label for seq in chosen for label in seq.labels], dtype=torch.long)
    return PackedBatch(
        input_ids_1T=torch.tensor([tokens], dtype=torch.long),
        position_ids_1T=torch.cat(positions).unsqueeze(0),
        cu_seq_lens=torch.tensor(bounds, dtype=torch.int32),
        max_length=max_length,
        label_positions_K=label_index(labels),
        labels_NL=padded.labels_NL,
        advantages_NL=padded.advantages_NL,
        rollout_logprobs_NL=padded.rollout_logprobs_NL,
        sequence_indices=list(indices),
        label_index_K=padded.label_index_K,
        routed_experts_TLK=routed,
        routed_mask_T=routed_mask,
        real_tokens=real_tokens,
    )


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
