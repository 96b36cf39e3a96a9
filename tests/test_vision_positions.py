"""Multimodal RoPE positions computed per sample (engine.vision.positions) against transformers' own
``get_rope_index`` on the tiny Qwen2-VL policy, and the tiny policy's chat template with images."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from trellis.engine.tiny.vlm import IMAGE_PAD, MERGE_SIZE, PATCH_SIZE, build_vlm_model, build_vlm_tokenizer
from trellis.engine.vision.positions import collapse_image_placeholders, expand_image_placeholders, extend_positions, mrope_positions


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_vlm_tokenizer()
    return tokenizer, build_vlm_model(tokenizer).eval()


def _images(*sizes: tuple[int, int]):
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, min_pixels=28 * 28, max_pixels=140 * 140
    )
    out = processor(images=[Image.new("RGB", size, (200, 30, 30)) for size in sizes], return_tensors="pt")
    return out["pixel_values"], [tuple(grid) for grid in out["image_grid_thw"].tolist()]


def test_positions_equal_transformers_and_give_the_models_logits(policy):
    tokenizer, model = policy
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    pixels, grids = _images((80, 60), (30, 140))  # two images of unequal grids: [1, 4, 6] and [1, 10, 2]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt.count(pad) == 2, "the template writes one placeholder per image"
    response = tokenizer("abc", add_special_tokens=False)["input_ids"]
    expanded = expand_image_placeholders(prompt, grids, image_token_id=pad, merge_size=MERGE_SIZE)
    assert len(expanded) == len(prompt) - 2 + 6 + 5
    ids = torch.tensor([expanded + response])
    theirs, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == pad).int(), image_grid_thw=torch.tensor(grids))

    ours = extend_positions(mrope_positions(expanded, grids, image_token_id=pad, merge_size=MERGE_SIZE), len(response))
    assert torch.equal(ours, theirs[:, 0])
    assert not torch.equal(ours[0], ours[1]), "the images' rows differ, or the test shows nothing"
    with torch.no_grad():
        own = model(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor(grids), mm_token_type_ids=(ids == pad).int())
        given = model(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor(grids), position_ids=ours[:, None])
    torch.testing.assert_close(given.logits, own.logits)


def test_placeholders_that_do_not_match_the_images_are_refused():
    grid = (1, 4, 6)  # six placeholders after the 2 x 2 merge
    with pytest.raises(ValueError, match="1 image"):
        mrope_positions([5, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 5], [grid], image_token_id=9, merge_size=2)
    with pytest.raises(ValueError, match="shorter"):
        mrope_positions([5, 9, 9, 9, 5], [grid], image_token_id=9, merge_size=2)
    with pytest.raises(ValueError, match="placeholders for 1"):
        mrope_positions([5, 9, 9, 9, 9, 9, 9, 5], [grid, grid], image_token_id=9, merge_size=2)


def test_expanding_refuses_more_images_than_placeholders():
    with pytest.raises(ValueError, match="2 image"):
        expand_image_placeholders([5, 9, 5], [(1, 4, 6), (1, 4, 6)], image_token_id=9, merge_size=2)
    assert expand_image_placeholders([5, 9, 5], [(1, 4, 6)], image_token_id=9, merge_size=2) == [5] + [9] * 6 + [5]


def test_text_only_positions_are_the_plain_range():
    positions = extend_positions(mrope_positions([3, 4, 5], [], image_token_id=9, merge_size=2), 2)
    assert positions.tolist() == [[0, 1, 2, 3, 4]] * 3


def test_collapsing_placeholders_undoes_their_expansion():
    ids = [1, 9, 7, 8, 2, 9, 7, 8, 3]  # 9 starts an image, 7 is its placeholder, 8 ends it
    expanded = expand_image_placeholders(ids, [(1, 4, 4), (1, 2, 6)], image_token_id=7, merge_size=2)
    assert expanded.count(7) == 4 + 3
    assert collapse_image_placeholders(expanded, image_token_id=7) == ids
