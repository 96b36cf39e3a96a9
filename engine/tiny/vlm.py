"""The tiny vision-language policy, built offline: the tiny tokenizer with Qwen2-VL's vision
tokens, a chat template whose messages may hold images, and a random ~1M-parameter Qwen2-VL model
whose text half has the tiny text model's shape.

Separate builders from ``engine.tiny.model`` on purpose: four more tokens change the vocabulary, and
with it the seeded initialization the text model's pinned warm-up depends on.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil as Qwen2VLImageProcessor,  # the processor that needs no torchvision
)

from trellis.engine.tiny.model import CHAT_TEMPLATE, DECODER_SHAPE, IM_END, Example, build_tokenizer
from trellis.engine.tiny.reverse_task import make_example
from trellis.engine.tiny.shapes_task import make_example as make_shapes_example
from trellis.engine.vision.positions import expand_image_placeholders

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"  # in the vocabulary for vLLM's config checks; trellis takes no video
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
# Held-out accuracy of the first answer token climbs from the answer prior (~0.33) at step 200 to
# ~0.77 by step 250 (lr 3e-4, batch 32, data seed 1); 220 lands at ~0.54, leaving RL room to learn.
WARMUP_STEPS, WARMUP_BATCH, WARMUP_SEED = 220, 32, 1
VISION_TOKEN_IDS = {  # the config's id fields, and the tokens they name
    "image_token_id": IMAGE_PAD,
    "video_token_id": VIDEO_PAD,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}
# A message's content is a string, or a list of {"type": "text", "text": ...} and {"type": "image"}
# parts; an image is one placeholder here, which the processor expands to the image's token count.
_CONTENT = "{{ message['content'] or '' }}"
_PARTS = (
    "{% if message['content'] is string or message['content'] is none %}" + _CONTENT + "{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    + VISION_START + IMAGE_PAD + VISION_END
    + "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
)
VLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_CONTENT, _PARTS)


def build_vlm_tokenizer(seed: int = 0, make_example: Example = make_example) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer(seed, make_example)
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]}, replace_extra_special_tokens=False
    )
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_vlm_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Qwen2VLForConditionalGeneration:
    torch.manual_seed(seed)
    text = dict(
        vocab_size=len(tokenizer),
        **DECODER_SHAPE,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # The three sections split a head's 16 rotary frequencies between time, height and width.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    )
    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=DECODER_SHAPE["hidden_size"],  # the merger's output: the text model's width
        num_heads=2,
        mlp_ratio=2,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKEN_IDS.items()}
    config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return model




def build_image_processor() -> Qwen2VLImageProcessor:
    """Qwen2-VL's image processor at the tiny model's patch sizes: an image keeps its size between
    56 x 56 and 448 x 448 pixels, rounded to whole merged patches (84 x 84 gives 3 x 3 tokens)."""
    cell = PATCH_SIZE * MERGE_SIZE
    return Qwen2VLImageProcessor(
        size={"shortest_edge": (2 * cell) ** 2, "longest_edge": (16 * cell) ** 2},
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )


def save_tiny_vlm(out_dir: str | Path, seed: int = 0, *, warmup: bool = False) -> Path:
    """The tiny VL model, its tokenizer and image processor as one HF folder; ``warmup``: trained on
    the shapes task first (``warm_up``), else random weights."""
    out_dir = Path(out_dir)
    tokenizer = build_vlm_tokenizer(seed)
    model = build_vlm_model(tokenizer, seed)
    if warmup:
        warm_up(model, tokenizer, build_image_processor())
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    build_image_processor().save_pretrained(out_dir)
    return out_dir


def warm_up(model, tokenizer, processor, *, steps: int = WARMUP_STEPS, seed: int = WARMUP_SEED) -> None:
    """Supervised steps on the shapes task, vision tower included, ~20 s on 2 cores."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.98))
    model.train()
    for _ in range(steps):
        loss = model(**supervised_batch(tokenizer, processor, [make_shapes_example(rng) for _ in range(WARMUP_BATCH)])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def supervised_batch(tokenizer, processor, examples) -> dict[str, torch.Tensor]:
    """Right-padded rows of (image prompt, answer): the loss on the answer and its closing <|im_end|>."""
    inputs = processor(images=[image for image, _, _ in examples], return_tensors="pt")
    image_token = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    rows = []
    for (_, question, answer), grid in zip(examples, inputs["image_grid_thw"].tolist()):
        content = [{"type": "image"}, {"type": "text", "text": question}]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False)
        prompt = expand_image_placeholders(prompt, [tuple(grid)], image_token_id=image_token, merge_size=MERGE_SIZE)
        target = tokenizer(answer + IM_END, add_special_tokens=False)["input_ids"]
        rows.append((prompt + target, [-100] * len(prompt) + target))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (ids, targets) in enumerate(rows):
        input_ids[row, : len(ids)], labels[row, : len(ids)], attention_mask[row, : len(ids)] = torch.tensor(ids), torch.tensor(targets), 1
    return dict(
        input_ids=input_ids, attention_mask=attention_mask, labels=labels, pixel_values=inputs["pixel_values"],
        image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=(input_ids == image_token).int(),
    )
