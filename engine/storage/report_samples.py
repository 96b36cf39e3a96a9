"""The report's pictures: for a run whose prompts hold images, what the policy looked at in its last
stored training step, as thumbnails beside the prompt, the label and the group's responses."""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from typing import Any

from trellis.engine.parquet_reads import read_parquet
from trellis.engine.storage.lake import partition_uri, stored_steps
from trellis.engine.storage.lake_images import fetched, images_of
from trellis.engine.storage.store import Store

THUMBNAIL_PIXELS = 128


@dataclass(frozen=True)
class SamplePicture:
    step: int
    thumbnails: list[bytes]  # PNG, at most THUMBNAIL_PIXELS a side
    prompt: str
    label: str | None
    responses: list[tuple[str, float | None]]  # (response, reward)


def sample_pictures(run: Store, limit: int = 6) -> list[SamplePicture]:
    """Up to ``limit`` prompts with images from the newest stored train step; none for a text run."""
    steps = stored_steps(run, "train")
    if not steps:
        return []
    step = steps[-1]
    fs, path = Store(f"{partition_uri(run.uri, 'train', step)}/part-0.parquet", run.options).fs()
    table = read_parquet(fs, path)
    if "images" not in table.schema.names:
        return []
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in table.select(["group_id", "prompt", "label", "response", "reward", "images"]).to_pylist():
        if row["images"] and (row["group_id"] in groups or len(groups) < limit):
            groups.setdefault(row["group_id"], []).append(row)
    return [
        SamplePicture(
            step=step,
            thumbnails=[_thumbnail(cell, run) for cell in rows[0]["images"]],
            prompt="\n".join(m["content"] for m in rows[0]["prompt"]),
            label=rows[0]["label"],
            responses=[(row["response"], row["reward"]) for row in rows],
        )
        for rows in groups.values()
    ]


def _thumbnail(cell: dict[str, Any], run: Store) -> bytes:
    (stored,) = images_of([cell])
    picture = fetched(stored, run.options).decode()
    picture.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def pictures_html(pictures: list[SamplePicture]) -> str:
    """The report's section of pictures (empty without any)."""
    if not pictures:
        return ""
    cards = []
    for picture in pictures:
        images = "".join(f'<img class="thumb" alt="prompt image" src="data:image/png;base64,{base64.b64encode(png).decode()}">' for png in picture.thumbnails)
        answers = "".join(
            f"<li>{html.escape(text)} <small>({'-' if reward is None else f'{reward:.2f}'})</small></li>" for text, reward in picture.responses
        )
        label = f"<p>label: {html.escape(picture.label)}</p>" if picture.label is not None else ""
        cards.append(f'<div class="sample">{images}<p>{html.escape(picture.prompt)}</p>{label}<ul>{answers}</ul></div>')
    return f'<h2 id="samples">What the policy saw at step {pictures[0].step}</h2>\n<div class="samples">{"".join(cards)}</div>'
