"""Small helpers over rows of token ids, shared by the rollout backend and training layouts."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch


def unique_rows(
    rows: Sequence[Sequence[int]], extra_keys: Sequence[Hashable] | None = None
) -> tuple[list[tuple[int, ...]], list[int]]:
    """Distinct rows in first-seen order, and for every input row the index of its distinct row.

    A GRPO group repeats one prompt G times; the callers run each distinct prompt once. ``extra_keys``:
    what else must match for two rows to be one (the images of a vision-language prompt: two pictures
    behind the same question have the same token ids).
    """
    index_of: dict[Hashable, int] = {}
    first: list[tuple[int, ...]] = []
    row_index = []
    for i, row in enumerate(rows):
        key = (tuple(row), extra_keys[i] if extra_keys is not None else None)
        if key not in index_of:
            index_of[key] = len(first)
            first.append(tuple(row))
        row_index.append(index_of[key])
    return first, row_index


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask [rows, longest], so every row ends at the last column."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.as_tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask
