"""Multimodal RoPE positions of Qwen2-VL-family policies, computed once per sequence, without the model.

Such a policy rotates each token by three positions (time, height, width). A text token has the same
value on all three rows; an image's tokens lay out its merged patch grid from where the text stopped,
and the text after the image resumes at the largest position so far plus one. The response is text,
so it continues the prompt's positions one by one (as the reference's trainer extends them).

transformers computes the same rows inside the model (``get_rope_index``), from a batch and the
module's cached state; trellis computes them per sample instead, so rollout, the lake and packing can
carry them with each sequence. The test holds this module to transformers' result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ImageGrid = tuple[int, int, int]  # (t, h, w) patches of one image before the spatial merge


def image_token_count(grid: ImageGrid, merge_size: int) -> int:
    """How many placeholder tokens stand for an image in the sequence the model reads."""
    t, h, w = grid
    return t * h * w // (merge_size * merge_size)


def expand_image_placeholders(
    token_ids: Sequence[int], image_grids: Sequence[ImageGrid], *, image_token_id: int, merge_size: int
) -> list[int]:
    """The ids the model reads, from a chat template's one placeholder an image: vLLM takes the short
    form and expands it itself; the trainer and the lake hold the expanded form."""
    if (found := sum(token == image_token_id for token in token_ids)) != len(image_grids):
        raise ValueError(f"{len(image_grids)} image(s) given, and the prompt holds {found} image placeholder(s)")
    counts = iter(image_token_count(grid, merge_size) for grid in image_grids)
    return [id_ for token in token_ids for id_ in ([token] * next(counts) if token == image_token_id else [token])]


def collapse_image_placeholders(token_ids: Sequence[int], *, image_token_id: int) -> list[int]:
    """The inverse of ``expand_image_placeholders``: each run of placeholders back to one (what vLLM
    takes with the images, expanding it itself). Images in a chat template sit between their own
    start and end tokens, so two images never make one run."""
    return [token for i, token in enumerate(token_ids) if token != image_token_id or i == 0 or token_ids[i - 1] != image_token_id]


def mrope_positions(
    token_ids: Sequence[int], image_grids: Sequence[ImageGrid], *, image_token_id: int, merge_size: int
) -> torch.Tensor:
    """The (3, len(token_ids)) positions of one unpadded sequence whose images are already expanded to
    ``image_token_count`` placeholders each, in order."""
    rows: list[torch.Tensor] = []
    grids = list(image_grids)
    next_pos, index, used = 0, 0, 0
    while index < len(token_ids):
        end = index
        is_image = token_ids[index] == image_token_id
        while end < len(token_ids) and (token_ids[end] == image_token_id) == is_image:
            end += 1
        if not is_image:
            rows.append(torch.arange(next_pos, next_pos + end - index).expand(3, -1))
            next_pos += end - index
        else:
            run = end - index
            while run > 0:
                if used == len(grids):
                    raise ValueError(f"the sequence holds more image tokens than its {len(grids)} image(s) account for")
                block, next_pos = _image_block(grids[used], merge_size, next_pos)
                rows.append(block)
                run -= block.shape[1]
                used += 1
            if run < 0:
                raise ValueError(
                    f"image {used - 1} needs {image_token_count(grids[used - 1], merge_size)} placeholder tokens, "
                    f"and the run holding it is shorter"
                )
        index = end
    if used != len(grids):
        raise ValueError(f"{len(grids)} image(s) given, and the sequence holds placeholders for {used}")
    return torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)


def extend_positions(positions: torch.Tensor, count: int) -> torch.Tensor:
    """Append ``count`` text positions (a response) after a (3, L) prompt."""
    start = int(positions.max()) + 1 if positions.numel() else 0
    return torch.cat([positions, torch.arange(start, start + count).expand(3, -1)], dim=1)


def _image_block(grid: ImageGrid, merge_size: int, start: int) -> tuple[torch.Tensor, int]:
    t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
    time, height, width = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    block = torch.stack([time, height, width]).reshape(3, -1) + start
    return block, start + max(h, w)
