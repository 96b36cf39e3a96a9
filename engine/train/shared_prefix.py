"""Micro-batches that run each distinct prompt once and share it across the samples of its group.

GRPO draws G responses per prompt, and with short answers most tokens of a batch are prompt tokens
repeated G times. Here the prompts go through the model once (left-padded, keeping their KV cache),
the cache is expanded to one row per sample, and only the responses are run on top of it. Gradients
flow back through the shared cache, so the result equals the padded layout's up to float rounding.

Shapes: U distinct prompts, P longest prompt, N samples, R longest response input (response minus
its last token), L = R + 1 label positions (the last prompt position predicts the first response token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from trellis.engine.data.prepare import IGNORE, TrainSequence
from trellis.engine.data.token_rows import left_pad, unique_rows
from trellis.engine.train.packing import LabelRows, label_index


@dataclass
class SharedPrefixBatch(LabelRows):
    prompt_ids_UP: torch.Tensor
    prompt_mask_UP: torch.Tensor
    prompt_index_N: torch.Tensor  # which prompt row each sample continues
    response_ids_NR: torch.Tensor
    response_mask_NR: torch.Tensor
    labels_NL: torch.Tensor
    advantages_NL: torch.Tensor
    rollout_logprobs_NL: torch.Tensor
    sequence_indices: list[int]
    label_index_K: torch.Tensor  # row-major positions of the K labels in [N, L]

    def label_hidden(self, decoder: torch.nn.Module) -> torch.Tensor:
        """Last hidden states of the labelled positions, row-major over ``loss_mask_NL``: [K, H]."""
        cache = DynamicCache()
        positions_UP = (self.prompt_mask_UP.cumsum(-1) - 1).clamp(min=0)
        prompt_hidden_UPH = decoder(
            input_ids=self.prompt_ids_UP,
            attention_mask=self.prompt_mask_UP,
            position_ids=positions_UP,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        first_N1H = prompt_hidden_UPH[:, -1:, :].index_select(0, self.prompt_index_N)
        if self.response_ids_NR.size(1) == 0:
            return first_N1H.flatten(0, 1).index_select(0, self.label_index_K)
        cache.reorder_cache(self.prompt_index_N)
        prompt_mask_NP = self.prompt_mask_UP.index_select(0, self.prompt_index_N)
        start_N1 = prompt_mask_NP.sum(-1, keepdim=True)
        positions_NR = start_N1 + torch.arange(self.response_ids_NR.size(1), device=start_N1.device)
        response_hidden_NRH = decoder(
            input_ids=self.response_ids_NR,
            attention_mask=torch.cat([prompt_mask_NP, self.response_mask_NR], dim=1),
            position_ids=positions_NR,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        return torch.cat([first_N1H, response_hidden_NRH], dim=1).flatten(0, 1).index_select(0, self.label_index_K)


def can_share(sequences: list[TrainSequence]) -> bool:
    return all(seq.prompt_length > 0 for seq in sequences)


def to_shared_prefix(sequences: list[TrainSequence], indices: list[int], pad_id: int) -> SharedPrefixBatch:
    chosen = [sequences[i] for i in indices]
    prompts, prompt_index = unique_rows([seq.input_ids[: seq.prompt_length] for seq in chosen])
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)

    responses = [seq.input_ids[seq.prompt_length :] for seq in chosen]
    response_width = max(len(r) for r in responses)
    response_ids = torch.full((len(chosen), response_width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(chosen), response_width), dtype=torch.long)
    label_shape = (len(chosen), response_width + 1)
    labels = torch.full(label_shape, IGNORE, dtype=torch.long)
    advantages = torch.zeros(label_shape)
    rollout_logprobs = torch.zeros(label_shape)
    for row, (seq, response) in enumerate(zip(chosen, responses)):
        response_ids[row, : len(response)] = torch.tensor(response, dtype=torch.long)
        response_mask[row, : len(response)] = 1
        start = seq.prompt_length - 1  # the last prompt position predicts the first response token
        span = len(seq.labels) - start
        labels[row, :span] = torch.tensor(seq.labels[start:])
        advantages[row, :span] = torch.tensor(seq.advantages[start:])
        rollout_logprobs[row, :span] = torch.tensor(seq.rollout_logprobs[start:])
    return SharedPrefixBatch(
        prompt_ids, prompt_mask, torch.tensor(prompt_index), response_ids, response_mask,
        labels, advantages, rollout_logprobs, list(indices), label_index(labels),
    )
