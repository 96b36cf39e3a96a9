"""The vision half of a training micro-batch (a vision-language policy): its images' pixel values and
grids, and multimodal positions for every token, laid out as the micro-batch lays out its ids.

The images travel with the sequences as encoded files (``PromptImage``); each rank turns its own
micro-batches into pixels, so no pixel tensor crosses the cluster.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from trellis.engine.data.prepare import TrainSequence
from trellis.engine.vision.images import PromptImage
from trellis.engine.vision.models import is_vision_language
from trellis.engine.vision.processor import VisionProcessor


@dataclass
class VisionRows:
    """The micro-batch's distinct images (a GRPO group's samples share theirs: the vision tower sees
    each once) and, per image placeholder run in token order, which of them it shows."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor  # [distinct images, 3]
    # packed: [4, 1, T], row 0 the positions within each sequence (where attention finds the
    # boundaries), rows 1-3 the multimodal ones; padded: [3, N, L]
    position_ids: torch.Tensor
    image_index: tuple[int, ...]

    def to(self, device: torch.device) -> VisionRows:
        return VisionRows(*(t.to(device) for t in (self.pixel_values, self.image_grid_thw, self.position_ids)), self.image_index)

    def model_inputs(self) -> dict[str, Any]:
        """The vision tower casts the pixel values to its own dtype."""
        return {
            "pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw, "position_ids": self.position_ids,
            "image_index": self.image_index,
        }


def with_vision(batch: Any, sequences: list[TrainSequence], processor: VisionProcessor) -> Any:
    """``batch`` (a packed or padded layout of ``sequences``) with its ``vision`` rows; unchanged when
    none of the sequences has an image."""
    if not any(seq.images for seq in sequences):
        return batch
    images = [image for seq in sequences for image in seq.images]
    distinct: dict[str, PromptImage] = {}
    for image in images:
        distinct.setdefault(image.ref.sha256, image)
    order = {sha: i for i, sha in enumerate(distinct)}
    inputs = processor.inputs([image.decode() for image in distinct.values()])
    index = tuple(order[image.ref.sha256] for image in images)
    grids = iter([inputs.grids[i] for i in index])
    positions = [processor.positions(seq.input_ids, [next(grids) for _ in seq.images]) for seq in sequences]
    if hasattr(batch, "position_ids_1T"):  # packed: one row, a fill sequence at the end where the shape is fixed
        text_1T = batch.position_ids_1T
        fill = text_1T.size(1) - sum(p.size(1) for p in positions)
        rows_3T = torch.cat([*positions, torch.arange(fill).expand(3, -1)], dim=1)
        position_ids = torch.cat([text_1T.to(rows_3T.device), rows_3T]).unsqueeze(1)
    else:
        position_ids = torch.zeros(3, *batch.input_ids_NL.shape, dtype=torch.long)
        for row, rows_3L in enumerate(positions):
            position_ids[:, row, : rows_3L.size(1)] = rows_3L
    return replace(batch, vision=VisionRows(inputs.pixel_values, inputs.image_grid_thw, position_ids, index))


def policy_body(model: torch.nn.Module):
    """What turns a layout's inputs into last hidden states: the decoder of a text policy; for a
    vision-language one, the vision tower's image features scattered into the token embeddings,
    then its language model (called apart, so that packed attention's arguments reach only it)."""
    if not is_vision_language(model.config):
        return model.get_decoder()
    return functools.partial(_vision_language_hidden, model.model)


def _vision_language_hidden(body: torch.nn.Module, *, input_ids, pixel_values=None, image_grid_thw=None, image_index=(), **kwargs):
    embeds = body.get_input_embeddings()(input_ids)
    if pixel_values is not None:
        frozen = not next(body.visual.parameters()).requires_grad
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
            per_image = body.get_image_features(pixel_values, image_grid_thw, return_dict=True).pooler_output
        features = torch.cat([per_image[i] for i in image_index])
        image_mask, _ = body.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=features)
        embeds = embeds.masked_scatter(image_mask, features.to(embeds.dtype))
    return body.language_model(inputs_embeds=embeds, **kwargs)
