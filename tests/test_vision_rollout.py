"""Rollout of a vision-language policy on CPU (issue 34): the transformers backend takes prompts with
images, and every response's logprobs are the ones transformers' own forward gives the full sequence
(its pixels and its multimodal positions computed by the model itself), so the backend's pixels,
positions and KV cache hold; two pictures behind the same question are two prompts, not one."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from trellis.engine.config import DatasetConfig
from trellis.engine.data.prompts import load_prompts
from trellis.engine.rollout.backends.base import ImagePrompt, SamplingParams
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
from trellis.engine.tiny import shapes_task
from trellis.engine.tiny.vlm import save_tiny_vlm
from trellis.engine.vision.processor import VisionProcessor


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm")
    path = str(save_tiny_vlm(folder / "model", seed=3))
    tokenizer = AutoTokenizer.from_pretrained(path)
    vision = VisionProcessor.of_model(path)
    data = shapes_task.write_dataset(folder / "shapes.parquet", count=24, seed=5)
    records, _ = load_prompts(DatasetConfig(path=str(data)), tokenizer, vision)
    return path, tokenizer, vision, records


def _same_question_other_picture(records):
    for i, first in enumerate(records):
        for second in records[i + 1 :]:
            if first.prompt_ids == second.prompt_ids and first.images[0].ref != second.images[0].ref:
                return first, second
    raise AssertionError("the dataset holds no two pictures behind one question")


def _teacher_forced(model, vision, prompt, response_ids) -> torch.Tensor:
    inputs = vision.inputs([image.decode() for image in prompt.images])
    ids = torch.tensor([list(prompt) + response_ids])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=inputs.pixel_values,
            image_grid_thw=inputs.image_grid_thw,
            mm_token_type_ids=(ids == vision.image_token_id).int(),
        ).logits[0].float()
    start = len(prompt) - 1
    logprobs = torch.log_softmax(logits[start : start + len(response_ids)], dim=-1)
    return logprobs.gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def test_image_prompts_roll_out_with_the_models_own_logprobs(vlm):
    path, tokenizer, vision, records = vlm
    first, second = _same_question_other_picture(records)
    prompts = [ImagePrompt(r.prompt_ids, r.images) for r in (first, first, second, records[0], records[1])]
    backend = TransformersRollout(path, tokenizer)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)

    generations = backend.generate(prompts, params)

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    for prompt, generation in zip(prompts, generations):
        assert generation.response_ids, "a sample generated nothing"
        expected = _teacher_forced(model, vision, prompt, generation.response_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)
    # Greedy: the same question over another picture is answered from that picture, so it gets the
    # logits of its own forward (it was not merged with the first picture's prompt).
    greedy = backend.generate(prompts[1:3], SamplingParams(max_new_tokens=4, temperature=0.0))
    alone = [backend.generate([p], SamplingParams(max_new_tokens=4, temperature=0.0))[0] for p in prompts[1:3]]
    assert [g.response_ids for g in greedy] == [a.response_ids for a in alone]
    torch.testing.assert_close(torch.tensor(greedy[1].logprobs), torch.tensor(alone[1].logprobs), atol=1e-5, rtol=0)


def test_a_text_prompt_on_the_vision_model_still_generates(vlm):
    path, tokenizer, _, _ = vlm
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "count red"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    generation = TransformersRollout(path, tokenizer).generate([ids], SamplingParams(max_new_tokens=3, temperature=0.0))[0]
    assert len(generation.response_ids) >= 1 and generation.finish_reason in ("stop", "length")


def test_a_response_never_holds_an_image_placeholder(vlm):
    """A run's step failed on a sampled <|image_pad|> before the ban: the trainer read it as an image
    token without an image. The ban only decides what may be drawn; the logprob is the full softmax's."""
    from trellis.engine.rollout.backends.transformers_backend import sample_tokens

    _, _, vision, _ = vlm
    logits = torch.zeros(64, 290)
    logits[:, vision.special_token_ids] = 8.0  # the placeholders are the likeliest tokens by far
    banned = torch.tensor(vision.special_token_ids)
    for temperature in (0.0, 1.0):
        tokens, logprobs = sample_tokens(logits, SamplingParams(max_new_tokens=1, temperature=temperature), torch.Generator().manual_seed(0), banned)
        assert not set(tokens.tolist()) & set(vision.special_token_ids)
        expected = torch.log_softmax(logits / (temperature or 1.0), -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs, expected)
