"""Group training sequences into micro-batches of at most ``pack_max_length`` tokens.

Which sequences share a micro-batch is decided by the token budget (first-fit, order kept). How the
micro-batch is laid out for the model is a separate choice: ``to_padded`` gives right-padded rows,
which on CPU beat one long packed row (attention cost grows with the row length squared).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.prepare import IGNORE, TrainSequence


@dataclass
class MicroBatch:
    """Right-padded rows. N sequences, L = longest sequence."""

    input_ids_NL: torch.Tensor
    attention_mask_NL: torch.Tensor
    labels_NL: torch.Tensor
    advantages_NL: torch.Tensor
    rollout_logprobs_NL: torch.Tensor
    sequence_indices: list[int]  # positions of these sequences in the mini-batch

    @property
    def loss_mask_NL(self) -> torch.Tensor:
        return self.labels_NL != IGNORE

    @property
    def num_sequences(self) -> int:
        return self.input_ids_NL.size(0)

    def logits(self, model: torch.nn.Module) -> torch.Tensor:
        """Logits aligned with ``labels_NL``: [N, L, V]."""
        return model(input_ids=self.input_ids_NL, attention_mask=self.attention_mask_NL).logits

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            self.input_ids_NL.to(device),
            self.attention_mask_NL.to(device),
            self.labels_NL.to(device),
            self.advantages_NL.to(device),
            self.rollout_logprobs_NL.to(device),
            self.sequence_indices,
        )


def pack(sequences: list[TrainSequence], pack_max_length: int) -> list[list[int]]:
    """Indices of ``sequences`` per micro-batch, each holding at most ``pack_max_length`` tokens."""
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, sequence in enumerate(sequences):
        if sequence.num_tokens > pack_max_length:
            raise ValueError(
                f"A sequence of {sequence.num_tokens} tokens exceeds pack_max_length={pack_max_length}; "
                "raise train_worker.pack_max_length or lower max_prompt_length / max_new_tokens."
            )
        if used + sequence.num_tokens > pack_max_length and current:
            packs.append(current)
            current, used = [], 0
        current.append(index)
        used += sequence.num_tokens
    if current:
        packs.append(current)
    return packs


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
    return MicroBatch(input_ids, attention, labels, advantages, rollout_logprobs, list(indices))
