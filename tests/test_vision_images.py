"""Image parts of prompt rows (engine.vision.images): every source form reads back the same pixels and
hash, and what a user can get wrong (a missing file, a corrupt or truncated one, an image too large,
a part with no source) is refused with the reason a skip report counts."""

from __future__ import annotations

import fsspec
import pytest
from PIL import Image

from trellis.engine.tiny import shapes_task
from trellis.engine.vision.images import ImageError, image_sources, read_image

LIMIT = 64 * 64


def _png(size=(20, 10), colour=(200, 30, 30)) -> bytes:
    return shapes_task.png_bytes(Image.new("RGB", size, colour))


def test_every_source_form_gives_the_same_image_and_hash(tmp_path):
    data = _png()
    path = tmp_path / "red.png"
    path.write_bytes(data)
    with fsspec.open("memory://images/red.png", "wb") as handle:  # fsspec's in-memory filesystem, as s3:// goes
        handle.write(data)
    read = [
        read_image(data, max_pixels=LIMIT),
        read_image(str(path), max_pixels=LIMIT),
        read_image({"bytes": data, "path": "red.png"}, max_pixels=LIMIT),
        read_image({"bytes": None, "path": str(path)}, max_pixels=LIMIT),
        read_image("memory://images/red.png", max_pixels=LIMIT),
    ]
    assert {ref.sha256 for _, ref in read} == {read[0][1].sha256}
    assert [ref.uri for _, ref in read] == [None, str(path), "red.png", str(path), "memory://images/red.png"]
    for image, _ in read:
        assert image.mode == "RGB" and image.size == (20, 10) and image.getpixel((3, 3)) == (200, 30, 30)
    assert read_image(_png(colour=(0, 0, 255)), max_pixels=LIMIT)[1].sha256 != read[0][1].sha256


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("/nowhere/missing.png", "missing image file"),
        (b"not an image at all", "unreadable image"),
        (_png()[:60], "unreadable image"),  # a PNG cut short, as a failed upload leaves it
        (_png(size=(100, 100)), "image too large"),
        (None, "image without a source"),
        (42, "image without a source"),
    ],
)
def test_bad_images_are_refused_with_their_reason(source, reason):
    with pytest.raises(ImageError) as caught:
        read_image(source, max_pixels=LIMIT)
    assert caught.value.reason == reason


def test_image_sources_in_template_order():
    messages = [
        {"role": "system", "content": "count"},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "and"}, {"type": "image", "image": b"b"}]},
        {"role": "user", "content": [{"type": "image", "image": "c.png"}]},
    ]
    assert image_sources(messages) == ["a.png", b"b", "c.png"]


def test_the_shapes_task_rows_read_back_from_parquet_and_their_labels_are_true(tmp_path):
    import pyarrow.parquet as pq

    path = shapes_task.write_dataset(tmp_path / "shapes.parquet", count=40, seed=3)
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 40 and len({row["label"] for row in rows}) >= 3, "the answers vary"
    for row in rows:
        (source,) = image_sources(row["prompt"])
        image, _ = read_image(source, max_pixels=LIMIT * 4)
        asked = row["prompt"][0]["content"][1]["text"].removeprefix("count ")
        centres = [image.getpixel((x * shapes_task.CELL + 14, y * shapes_task.CELL + 14)) for y in range(3) for x in range(3)]
        assert str(centres.count(shapes_task.COLOURS[asked])) == row["label"]
        assert shapes_task.score({"response": f" {row['label']}\n", "label": row["label"]}) == 1.0
