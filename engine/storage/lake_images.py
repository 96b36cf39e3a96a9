"""Images in the trajectory lake: a row keeps a reference to each of its prompt's images (content hash
and where the file is), never pixels. An image that came inline (bytes in the dataset row) is written
once per run to ``{run}/images/{sha256}``, so a reference can always be followed back to its file:
for the HTML report's thumbnails, a replayed step, or a resumed run's buffer.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterable, Mapping

import pyarrow as pa

from trellis.engine.data.samples import RolloutSample
from trellis.engine.storage.store import Store
from trellis.engine.vision.images import ImageRef, PromptImage

IMAGE_TYPE = pa.struct([("sha256", pa.string()), ("uri", pa.string()), ("bytes", pa.binary())])
IMAGE_MARK = "<image>"  # an image part in the prompt column's text


def store_inline_images(samples: Iterable[RolloutSample], run: Store) -> dict[str, str]:
    """Write the images that have no file of their own under ``{run}/images/``; their URIs, by hash."""
    stored: dict[str, str] = {}
    for image in (image for sample in samples for image in sample.images):
        sha = image.ref.sha256
        if image.ref.uri is not None or sha in stored or image.data is None:
            continue
        target = run.join("images", sha)
        fs, path = target.fs()
        if not fs.exists(path):  # written under a temporary name and renamed: a crash leaves no half image
            folder = path.rsplit("/", 1)[0]
            fs.makedirs(folder, exist_ok=True)
            temporary = f"{folder}/.{sha}.{uuid.uuid4().hex}.tmp"
            with fs.open(temporary, "wb") as handle:
                handle.write(image.data)
            fs.mv(temporary, path)
        stored[sha] = target.uri
    return stored


def image_cells(images: Iterable[PromptImage], stored: Mapping[str, str]) -> list[dict[str, Any]]:
    """A row's ``images`` cell; an inline image not stored in the lake keeps its bytes (a buffer's state)."""
    cells = []
    for image in images:
        uri = image.ref.uri or stored.get(image.ref.sha256)
        cells.append({"sha256": image.ref.sha256, "uri": uri, "bytes": None if uri else image.data})
    return cells


def images_of(cells: list[dict[str, Any]] | None) -> list[PromptImage]:
    return [PromptImage(ImageRef(cell["sha256"], cell["uri"]), cell["bytes"]) for cell in cells or []]


def fetched(image: PromptImage, storage_options: Mapping[str, Any]) -> PromptImage:
    """``image`` with its file's bytes, read through fsspec with the lake's options (an S3 lake's images
    are read where the options are known, not in the trainer)."""
    if image.data is not None or image.ref.uri is None:
        return image
    with Store(image.ref.uri, storage_options).open("rb") as handle:
        return PromptImage(image.ref, handle.read())


def prompt_cells(messages: list[dict[str, Any]]) -> tuple[list[dict[str, str]], str | None]:
    """The ``prompt`` column (text, an image part shown as ``<image>``) and, for messages made of
    parts, the ``prompt_parts`` column that gives them back exactly (JSON)."""
    if all(isinstance(m["content"], str) for m in messages):
        return messages, None
    text = [{"role": m["role"], "content": _text_of(m["content"])} for m in messages]
    return text, json.dumps(messages)


def messages_of(prompt: list[dict[str, str]] | None, parts: str | None) -> list[dict[str, Any]]:
    return json.loads(parts) if parts else list(prompt or [])


def _text_of(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(IMAGE_MARK if part["type"] == "image" else part["text"] for part in content)
