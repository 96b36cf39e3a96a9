"""Images in prompt rows: where they come from, reading them through fsspec, and refusing bad ones.

A message's content may be a list of parts; an image part is ``{"type": "image", "image": SOURCE}``.
SOURCE is the image's bytes, a path or URI (``s3://...`` included, read with the dataset's storage
options), or the ``{"bytes": ..., "path": ...}`` form Hugging Face datasets write to Parquet.

What the lake keeps of an image is an ``ImageRef``: its content hash and where it was read from,
never its pixels.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
from PIL import Image, UnidentifiedImageError


class ImageError(ValueError):
    """An image a row names cannot be used; ``reason`` is the short form a skip report counts."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class ImageRef:
    sha256: str
    uri: str | None  # None when the row carried the bytes themselves


def image_sources(messages: Iterable[Mapping[str, Any]]) -> list[Any]:
    """The image parts' sources, in the order the chat template will place them."""
    sources = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            sources += [part.get("image") for part in content if isinstance(part, Mapping) and part.get("type") == "image"]
    return sources


@dataclass(frozen=True)
class PromptImage:
    """An image as it travels with a prompt's samples: its encoded file (never decoded pixels, which
    are many times larger) and its reference."""

    ref: ImageRef
    data: bytes | None = None  # None where only the reference was kept: it is read again from ref.uri

    def decode(self, storage_options: Mapping[str, Any] | None = None) -> Image.Image:
        if self.data is not None:
            return Image.open(io.BytesIO(self.data)).convert("RGB")
        if self.ref.uri is None:
            raise ImageError("image without a source", f"image {self.ref.sha256[:12]} kept neither its bytes nor where it is")
        with fsspec.open(self.ref.uri, "rb", **(storage_options or {})) as handle:
            return Image.open(io.BytesIO(handle.read())).convert("RGB")


def read_image(source: Any, *, max_pixels: int, storage_options: Mapping[str, Any] | None = None) -> tuple[Image.Image, ImageRef]:
    """Decode one image source to RGB; raise ``ImageError`` for a missing, unreadable or oversized one."""
    image, prompt_image = load_image(source, max_pixels=max_pixels, storage_options=storage_options)
    return image, prompt_image.ref


def load_image(source: Any, *, max_pixels: int, storage_options: Mapping[str, Any] | None = None) -> tuple[Image.Image, PromptImage]:
    """As ``read_image``, keeping the encoded bytes for the samples to carry."""
    data, uri = _image_bytes(source, storage_options or {})
    name = uri or "inline image"
    try:
        with Image.open(io.BytesIO(data)) as probe:
            probe.verify()  # catches truncated and corrupt files that open() alone lets through
        image = Image.open(io.BytesIO(data))  # reads the header only: the size is known before the pixels
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError("image too large", f"{name} is {width}x{height}, over {max_pixels} pixels")
        image = image.convert("RGB")
    except Image.DecompressionBombError as error:
        raise ImageError("image too large", f"{name}: {error}") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise ImageError("unreadable image", f"{name}: {error}") from None
    return image, PromptImage(ImageRef(hashlib.sha256(data).hexdigest(), uri), data)


def _image_bytes(source: Any, storage_options: Mapping[str, Any]) -> tuple[bytes, str | None]:
    if isinstance(source, Mapping):  # Hugging Face datasets' Image feature
        if source.get("bytes"):
            return bytes(source["bytes"]), source.get("path") or None
        source = source.get("path")
    if isinstance(source, (bytes, bytearray)):
        return bytes(source), None
    if not isinstance(source, str) or not source:
        raise ImageError("image without a source", f"an image part holds {str(source)[:40]!r}, not bytes or a path")
    try:
        with fsspec.open(source, "rb", **storage_options) as handle:
            return handle.read(), source
    except FileNotFoundError:
        raise ImageError("missing image file", source) from None
    except OSError as error:
        raise ImageError("unreadable image", f"{source}: {error}") from None
