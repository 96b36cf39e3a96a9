"""The vision half of a training micro-batch (a vision-language policy): its images' pixel values and
grids (or, for a frozen vision tower, its output), and multimodal positions for every token, laid out
as the micro-batch lays out its ids.

The images travel with the sequences as encoded files (``PromptImage``); each rank turns its own
share into pixels, each distinct image once (``ImageTable``), so no pixel tensor crosses the cluster.
A frozen tower's output does not change during a fit: it is computed once for the share's images
(``ImageTable.features``) rather than in every micro-batch's forward, where it cost 18 tower calls a
step on an H200 image step (bench/RESULTS.md section 9).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from trellis.engine.data.prepare import TrainSequence
from trellis.engine.vision.images import PromptImage
from trellis.engine.vision.models import is_vision_language
from trellis.engine.vision.positions import ImageGrid
from trellis.engine.vision.processor import VisionProcessor, VisionInputs


class ImageTable:
    """The distinct images of some sequences (a GRPO group's samples share theirs), each decoded and
    processed once: pixel values and grid by content hash and, once ``compute_features`` ran, the
    vision tower's output for each."""

    def __init__(self, sequences: list[TrainSequence], processor: VisionProcessor) -> None:
        distinct: dict[str, PromptImage] = {}
        for image in (image for seq in sequences for image in seq.images):
            distinct.setdefault(image.ref.sha256, image)
        self.processor = processor
        self.keys = list(distinct)
        self.inputs = processor.inputs([image.decode() for image in distinct.values()]) if distinct else None
        grids = self.inputs.grids if self.inputs is not None else []
        self.grids: dict[str, ImageGrid] = dict(zip(self.keys, grids))
        bounds = list(itertools.accumulate((t * h * w for t, h, w in grids), initial=0))
        self._patches = {key: (start, end) for key, start, end in zip(self.keys, bounds, bounds[1:])}  # rows of pixel_values
        self.features: dict[str, torch.Tensor] | None = None

    def inputs_of(self, keys: list[str]) -> VisionInputs:
        """The tower's input for ``keys`` (distinct), in that order."""
        assert self.inputs is not None
        pixels = torch.cat([self.inputs.pixel_values[slice(*self._patches[key])] for key in keys])
        return VisionInputs(pixels, torch.tensor([self.grids[key] for key in keys], dtype=torch.long))

    def compute_features(self, tower: Callable[[VisionInputs], list[torch.Tensor]], max_patches: int) -> None:
        """Run ``tower`` (image inputs -> one feature tensor an image) over every image, at most
        ``max_patches`` patches a call (one image at least)."""
        self.features = {}
        chunk: list[str] = []
        patches = 0
        for key in self.keys:
            size = self._patches[key][1] - self._patches[key][0]
            if chunk and patches + size > max_patches:
                self.features.update(zip(chunk, tower(self.inputs_of(chunk))))
                chunk, patches = [], 0
            chunk.append(key)
            patches += size
        if chunk:
            self.features.update(zip(chunk, tower(self.inputs_of(chunk))))


@dataclass
class VisionRows:
    """A micro-batch's images: the pixel values of its distinct images and, per image placeholder run
    in token order, which of them it shows; or, for a frozen tower computed ahead, the tower's output
    for every run, in token order."""

    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None  # [distinct images, 3]
    # packed: [4, 1, T], row 0 the positions within each sequence (where attention finds the
    # boundaries), rows 1-3 the multimodal ones; padded: [3, N, L]
    position_ids: torch.Tensor
    image_index: tuple[int, ...]
    image_features: torch.Tensor | None = None

    def to(self, device: torch.device) -> VisionRows:
        moved = [None if t is None else t.to(device) for t in (self.pixel_values, self.image_grid_thw, self.position_ids)]
        features = None if self.image_features is None else self.image_features.to(device)
        return VisionRows(*moved, self.image_index, features)  # type: ignore[arg-type]

    def model_inputs(self) -> dict[str, Any]:
        """The vision tower casts the pixel values to its own dtype."""
        if self.image_features is not None:
            return {"image_features": self.image_features, "position_ids": self.position_ids}
        return {
            "pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw, "position_ids": self.position_ids,
            "image_index": self.image_index,
        }


def with_vision(batch: Any, sequences: list[TrainSequence], table: ImageTable) -> Any:
    """``batch`` (a packed or padded layout of ``sequences``) with its ``vision`` rows, its images taken
    from ``table``; unchanged when none of the sequences has an image."""
    if not any(seq.images for seq in sequences):
        return batch
    keys = [image.ref.sha256 for seq in sequences for image in seq.images]
    grids = iter([table.grids[key] for key in keys])
    positions = [table.processor.positions(seq.input_ids, [next(grids) for _ in seq.images]) for seq in sequences]
    if hasattr(batch, "position_ids_1T"):  # packed: one row, a fill sequence at the end where the shape is fixed
        text_1T = batch.position_ids_1T
        fill = text_1T.size(1) - sum(p.size(1) for p in positions)
        rows_3T = torch.cat([*positions, torch.arange(fill).expand(3, -1)], dim=1)
        position_ids = torch.cat([text_1T.to(rows_3T.device), rows_3T]).unsqueeze(1)
    else:
        position_ids = torch.zeros(3, *batch.input_ids_NL.shape, dtype=torch.long)
        for row, rows_3L in enumerate(positions):
            position_ids[:, row, : rows_3L.size(1)] = rows_3L
    if table.features is not None:
        features = torch.cat([table.features[key] for key in keys])
        return replace(batch, vision=VisionRows(None, None, position_ids, (), features))
    distinct = list(dict.fromkeys(keys))
    order = {key: i for i, key in enumerate(distinct)}
    inputs = table.inputs_of(distinct)
    index = tuple(order[key] for key in keys)
    return replace(batch, vision=VisionRows(inputs.pixel_values, inputs.image_grid_thw, position_ids, index))


def policy_body(model: torch.nn.Module):
    """What turns a layout's inputs into last hidden states: the decoder of a text policy; for a
    vision-language one, the vision tower's image features scattered into the token embeddings,
    then its language model (called apart, so that packed attention's arguments reach only it)."""
    if not is_vision_language(model.config):
        return model.get_decoder()
    return functools.partial(_vision_language_hidden, model.model)


def tower_output(body: torch.nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[torch.Tensor]:
    """A vision-language model's (``model.model``) vision tower output, one tensor an image; with a graph
    only while the tower trains."""
    frozen = not next(body.visual.parameters()).requires_grad
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
        return list(body.get_image_features(pixel_values, image_grid_thw, return_dict=True).pooler_output)


def _vision_language_hidden(
    body: torch.nn.Module, *, input_ids, pixel_values=None, image_grid_thw=None, image_index=(), image_features=None, **kwargs
):
    embeds = body.get_input_embeddings()(input_ids)
    if pixel_values is not None:
        per_image = tower_output(body, pixel_values, image_grid_thw)
        image_features = torch.cat([per_image[i] for i in image_index])
    if image_features is not None:
        image_mask, _ = body.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=image_features)
        embeds = embeds.masked_scatter(image_mask, image_features.to(embeds.dtype))
    return body.language_model(inputs_embeds=embeds, **kwargs)
