"""Small helpers over rows of token ids, shared by the rollout backend and training layouts."""

from __future__ import annotations

from typing import Sequence

import torch


def unique_rows(rows: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Distinct rows in first-seen order, and for every input row the index of its distinct row.

    A GRPO group repeats one prompt G times; the callers run each distinct prompt once.
    """
    index_of: dict[tuple[int, ...], int] = {}
    row_index = [index_of.setdefault(tuple(row), len(index_of)) for row in rows]
    return list(index_of), row_index


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask [rows, longest], so every row ends at the last column."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.as_tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask
