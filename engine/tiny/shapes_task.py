"""The bundled visual task: count the shapes of one colour in a small picture. ``count red`` -> ``2``.

The picture is a 3 x 3 grid of 28-pixel cells, 1-5 of them holding a square or a circle in red, green
or blue. A cell is exactly what one of Qwen2-VL's merged image tokens sees (14-pixel patches, merged
2 x 2), so the tiny vision tower has one token a shape.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from trellis.engine.rollout.rewards.builtin import exact_match
from trellis.engine.tiny.files import write_rows

CELL, GRID = 28, 3
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220)}
SHAPES = ("square", "circle")
DATA_SOURCE = "shapes"
EVAL_SEED_OFFSET = 3_000_017  # held-out pictures come from a separate random stream


def make_example(rng: random.Random) -> tuple[Image.Image, str, str]:
    """A picture, its question and the answer: how many shapes of the asked colour it holds (0-5)."""
    cells = rng.sample(range(GRID * GRID), rng.randint(1, 5))
    placed = [(cell, rng.choice(list(COLOURS)), rng.choice(SHAPES)) for cell in cells]
    asked = rng.choice(list(COLOURS))
    return draw(placed), f"count {asked}", str(sum(colour == asked for _, colour, _ in placed))


def draw(placed: list[tuple[int, str, str]]) -> Image.Image:
    image = Image.new("RGB", (CELL * GRID, CELL * GRID), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for cell, colour, shape in placed:
        left, top = (cell % GRID) * CELL + 5, (cell // GRID) * CELL + 5
        box = (left, top, left + CELL - 11, top + CELL - 11)
        (pen.rectangle if shape == "square" else pen.ellipse)(box, fill=COLOURS[colour])
    return image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Prompt rows with each picture's PNG bytes inline, as a user's Parquet dataset may carry them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        image, question, answer = make_example(rng)
        content = [{"type": "image", "image": png_bytes(image)}, {"type": "text", "text": question}]
        rows.append({"prompt": [{"role": "user", "content": content}], "label": answer, "data_source": DATA_SOURCE, "task_name": "shapes"})
    return rows


def write_dataset(path: str | Path, count: int, seed: int) -> Path:
    return write_rows(path, make_rows(count, seed))


score = exact_match  # 1.0 iff the stripped response is the count


def build_checkpoint(out_dir: str | Path, *, warmup: bool = True) -> Path:
    """The tiny vision-language model, tokenizer and image processor, warmed up on this task
    (``trellis tiny-model --vlm``)."""
    from trellis.engine.tiny.vlm import save_tiny_vlm

    return save_tiny_vlm(out_dir, warmup=warmup)
