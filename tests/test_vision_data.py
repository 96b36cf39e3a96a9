"""Image prompts from a dataset to the lake (issue 34): rows whose messages hold images are read with
each image's placeholder expanded to its token count; what a user can get wrong skips the row with
its reason (a missing file, a corrupt image, an oversized one, images that do not match the
template's placeholders) or stops the run (images for a text-only policy); the lake keeps references
to the images, never their pixels, and gives the samples back whole."""

from __future__ import annotations

import hashlib

import pyarrow.parquet as pq
import pytest
from PIL import Image
from transformers import AutoTokenizer

from trellis.engine.config import DatasetConfig
from trellis.engine.data.prompts import DatasetError, load_prompts
from trellis.engine.rollout.production.produce import new_groups
from trellis.engine.storage.lake import partition_uri, read_groups, write_samples
from trellis.engine.storage.store import Store
from trellis.engine.tiny import shapes_task
from trellis.engine.tiny.files import write_rows
from trellis.engine.tiny.vlm import IMAGE_PAD, save_tiny_vlm
from trellis.engine.vision.processor import VisionProcessor


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return str(save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm")))


def _row(content, label="1"):
    return {"prompt": [{"role": "user", "content": content}], "label": label}


def _image_row(image, text="count red"):
    """Hugging Face datasets' image form ({bytes, path}), so that one Parquet column holds every row."""
    source = {"bytes": image, "path": None} if isinstance(image, bytes) else {"bytes": None, "path": image}
    return _row([{"type": "image", "image": source}, {"type": "text", "text": text}])


def test_image_rows_load_with_expanded_placeholders_and_bad_ones_are_skipped_by_reason(tiny_vlm, tmp_path):
    picture = shapes_task.png_bytes(Image.new("RGB", (84, 84), (220, 40, 40)))
    on_disk = tmp_path / "wide.png"
    on_disk.write_bytes(shapes_task.png_bytes(Image.new("RGB", (168, 84), (40, 70, 220))))
    rows = [
        _image_row(picture),  # inline bytes: 84 x 84 -> a 6 x 6 patch grid -> 9 merged tokens
        _image_row(str(on_disk)),  # a path: 168 x 84 -> 18 tokens
        _row([{"type": "text", "text": "count blue"}]),  # a text row beside the image rows
        _image_row(str(tmp_path / "gone.png")),
        _image_row(b"\x89PNG not really"),
        _image_row(shapes_task.png_bytes(Image.new("RGB", (300, 300)))),
        _image_row(picture, text=f"count {IMAGE_PAD} red"),  # a second placeholder typed into the text
    ]
    write_rows(tmp_path / "data.parquet", rows)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    vision = VisionProcessor.of_model(tiny_vlm)
    config = DatasetConfig(path=str(tmp_path / "data.parquet"), max_image_pixels=200 * 200)

    records, report = load_prompts(config, tokenizer, vision)

    assert [r.index for r in records] == [0, 1, 2]
    pad = vision.image_token_id
    assert [r.prompt_ids.count(pad) for r in records] == [9, 18, 0]
    assert dict(report.skipped) == {
        "missing image file": 1, "unreadable image": 1, "image too large": 1, "images and placeholders differ": 1
    }
    assert "gone.png" in report.examples["missing image file"] and "300x300" in report.examples["image too large"]
    inline, from_path = records[0].images[0], records[1].images[0]
    assert inline.ref.sha256 == hashlib.sha256(picture).hexdigest() and inline.ref.uri is None and inline.data == picture
    assert from_path.ref.uri == str(on_disk)
    # The messages keep a reference in place of the bytes; the template renders one placeholder.
    assert records[0].messages[0]["content"][0] == {"type": "image", "image": f"sha256:{inline.ref.sha256}"}
    assert records[1].messages[0]["content"][0]["image"] == str(on_disk)


def test_images_for_a_text_only_policy_stop_the_run_with_a_clear_message(tiny_vlm, tmp_path):
    text_row = _row([{"type": "text", "text": "count "}, {"type": "text", "text": "red"}])
    write_rows(tmp_path / "text.parquet", [text_row])
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    (record,), _ = load_prompts(DatasetConfig(path=str(tmp_path / "text.parquet")), tokenizer, vision=None)
    assert record.messages[0]["content"] == "count red"  # text parts alone: one string, as any template renders
    write_rows(tmp_path / "data.parquet", [text_row, _image_row(shapes_task.png_bytes(Image.new("RGB", (84, 84))))])
    with pytest.raises(DatasetError, match="Row 1 .* holds images, and the policy is a text-only model"):
        load_prompts(DatasetConfig(path=str(tmp_path / "data.parquet")), tokenizer, vision=None)


def test_the_lake_keeps_image_references_and_gives_the_samples_back(tiny_vlm, tmp_path):
    path = shapes_task.write_dataset(tmp_path / "shapes.parquet", count=3, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    records, _ = load_prompts(DatasetConfig(path=str(path)), tokenizer, VisionProcessor.of_model(tiny_vlm))
    groups = new_groups(list(enumerate(records)), repeat=2, version=0, train_step=1, id_prefix="t")
    samples = [s for g in groups for s in g]
    run = Store(str(tmp_path / "run"))

    part = write_samples(samples, root=run, run="shapes", split="train", step=1)

    table = pq.read_table(part)
    assert "pixel" not in " ".join(table.schema.names)
    row = table.slice(0, 1).to_pylist()[0]
    assert row["prompt"][0]["content"] == "<image>" + shapes_task.make_rows(1, seed=1)[0]["prompt"][0]["content"][1]["text"]
    (cell,) = row["images"]
    assert cell["bytes"] is None and cell["uri"] == str(tmp_path / "run" / "images" / cell["sha256"])
    assert hashlib.sha256(open(cell["uri"], "rb").read()).hexdigest() == cell["sha256"]  # noqa: SIM115
    # Six samples of three pictures: each picture stored once.
    assert len(list((tmp_path / "run" / "images").iterdir())) == len({s.images[0].ref.sha256 for s in samples}) == 3
    back = [s for g in read_groups(run, "train", 1) for s in g]
    assert partition_uri(run.uri, "train", 1) in part
    for before, after in zip(samples, back):
        assert after.messages == before.messages and after.prompt_ids == before.prompt_ids
        assert after.images[0].ref.sha256 == before.images[0].ref.sha256
        assert after.images[0].decode().tobytes() == before.images[0].decode().tobytes()
