"""What a vision-language policy needs of its images: each image's patch grid, and the pixel values
its vision tower reads, from the image processor saved beside the model (``preprocessor_config.json``).

A text-only model has no ``VisionProcessor``: ``VisionProcessor.of_model`` returns None for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor

from trellis.engine.errors import SettingError
from trellis.engine.vision.models import is_vision_language
from trellis.engine.vision.positions import ImageGrid, expand_image_placeholders, image_token_count, mrope_positions


@dataclass
class VisionInputs:
    """The vision tower's input for some images: their patches end to end, and each image's grid."""

    pixel_values: torch.Tensor  # [patches, channels x temporal x patch x patch]
    image_grid_thw: torch.Tensor  # [images, 3]

    @property
    def grids(self) -> list[ImageGrid]:
        return [tuple(int(v) for v in row) for row in self.image_grid_thw.tolist()]  # type: ignore[misc]


class VisionProcessor:
    def __init__(self, image_processor: Any, *, image_token_id: int, special_token_ids: Sequence[int]) -> None:
        self._image_processor = image_processor
        self.image_token_id = image_token_id
        self.special_token_ids = sorted(set(special_token_ids) | {image_token_id})  # what a response may never hold
        self.merge_size = int(image_processor.merge_size)

    @classmethod
    def of_model(cls, model_path: str) -> VisionProcessor | None:
        """The processor of the model folder at ``model_path``; None for a text-only model."""
        config = AutoConfig.from_pretrained(model_path)
        if not is_vision_language(config):
            return None
        if not (Path(model_path) / "preprocessor_config.json").exists():
            raise SettingError(
                f"{model_path} is a vision-language model ({config.model_type}) without a preprocessor_config.json: "
                "save its image processor beside it (processor.save_pretrained(path))."
            )
        names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        special = [value for name in names if isinstance(value := getattr(config, name, None), int)]
        return cls(
            AutoImageProcessor.from_pretrained(model_path), image_token_id=config.image_token_id, special_token_ids=special
        )

    def save(self, folder: str) -> None:
        """Beside an exported model, so that the folder loads as a whole policy."""
        self._image_processor.save_pretrained(folder)

    def inputs(self, images: Sequence[Image.Image]) -> VisionInputs:
        out = self._image_processor(images=list(images), return_tensors="pt")
        return VisionInputs(out["pixel_values"], out["image_grid_thw"].long())

    def grids(self, images: Sequence[Image.Image]) -> list[ImageGrid]:
        return self.inputs(images).grids

    def token_count(self, grid: ImageGrid) -> int:
        return image_token_count(grid, self.merge_size)

    def positions(self, token_ids: Sequence[int], grids: Sequence[ImageGrid]) -> torch.Tensor:
        """The (3, len(token_ids)) multimodal positions of one sequence whose images are expanded."""
        return mrope_positions(token_ids, grids, image_token_id=self.image_token_id, merge_size=self.merge_size)

    def expand(self, token_ids: Sequence[int], grids: Sequence[ImageGrid]) -> list[int]:
        """A chat template's one placeholder per image, expanded to each image's token count."""
        return expand_image_placeholders(token_ids, grids, image_token_id=self.image_token_id, merge_size=self.merge_size)
