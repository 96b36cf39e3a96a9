"""Build the tiny tokenizer and Qwen2 model offline, warm them up on the task, save an HF checkpoint.

No model hub is reachable from CI, so trellis makes its own ~1M-parameter policy that starts at
roughly 39% greedy accuracy on the reverse task and has room to learn (recipe: shared/TINY_TASK.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from trellis.engine.tiny.reverse_task import make_example

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML; a tool message is shown as the user's <tool_response>, and an assistant message's OpenAI
# tool_calls as Hermes <tool_call> blocks, as Qwen's template does.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WARMUP_STEPS = 60  # accuracy jumps sharply between steps 50 and 70: the count is pinned on purpose
WARMUP_BATCH = 64
# The warm-up's outcome swings with its data stream (greedy 25-99% over seeds 1-25); seed 8 lands where
# the recipe says (greedy 38%, sampled 15%), leaving the RL run something to learn.
WARMUP_SEED = 8


# One (prompt, answer) pair of a task. The answer is the assistant's text (trained on, with the closing
# <|im_end|>), or a multi-turn session as (text, trained) segments holding their own end tokens.
Answer = Union[str, list[tuple[str, bool]]]
Example = Callable[[random.Random], tuple[str, Answer]]


def answer_segments(answer: Answer) -> list[tuple[str, bool]]:
    return [(answer + IM_END, True)] if isinstance(answer, str) else answer


def build_tokenizer(
    seed: int = 0, make_example: Example = make_example, added_tokens: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """``added_tokens`` (e.g. ``<tool_call>``) become single tokens that decoding keeps."""
    rng = random.Random(seed)
    lines = []
    for _ in range(2000):
        prompt, answer = make_example(rng)
        session = "".join(text for text, _ in answer_segments(answer))
        lines.append(f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n{session}\n")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex("[0-9A-Z]"), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[PAD, IM_START, IM_END],
    )
    core.train_from_iterator(lines, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=PAD, padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.add_tokens(list(added_tokens))
    return tokenizer


# The decoder's shape, shared by the tiny text and vision-language policies.
DECODER_SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **DECODER_SHAPE,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return model


@dataclass(frozen=True)
class KnockBack:
    """After a warm-up that reached its success, a few steps on a weak teacher's sessions (``make_example``)
    until greedy success on the probe falls to ``to_success`` or below. The skill the warm-up built stays
    and only its answers go wrong, so an RL run starts a known distance below where it can climb."""

    make_example: Example
    to_success: float
    lr: float = 1e-3
    max_steps: int = 50


# A warm-up that asks for a success goes on up to this many times its steps before it gives up.
MAX_STEPS_FACTOR = 8


def warm_up(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    seed: int = WARMUP_SEED,
    *,
    make_example: Example = make_example,
    steps: int = WARMUP_STEPS,
    first_turn_steps: int = 0,
    until_success: float | None = None,
    knock_back: KnockBack | None = None,
) -> None:
    """Supervised warm-up: loss on answer tokens and the closing <|im_end|> only. A multi-turn task
    trains on the first turn alone for ``first_turn_steps``: a ~1M model learns the later turns' copying
    far faster once the first turn's is in place. ``until_success``: after ``steps``, go on until greedy
    success on a fixed probe batch reaches it; where a task's sharp jump in success falls moves with the
    machine's arithmetic (the lookup task's: steps 141-146 on one CPU, ~310 on an AMD EPYC), so a pinned count can stop
    anywhere inside it. ``knock_back``: then lower the success to a set level (see ``KnockBack``)."""
    if knock_back is not None and until_success is None:
        raise ValueError("knock_back needs until_success: it starts from a warm-up that reached it")
    rng = random.Random(seed)
    probe = probe_batch(tokenizer, make_example, seed) if until_success is not None else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    model.train()
    step = 0
    while step < steps or (probe is not None and greedy_success(model, *probe) < until_success):
        if step == MAX_STEPS_FACTOR * steps:
            raise RuntimeError(f"the warm-up did not reach greedy success {until_success} in {step} steps")
        _train_step(model, optimizer, _supervised_batch(tokenizer, rng, make_example, first_turn_only=step < first_turn_steps))
        schedule.step()
        step += 1
    if knock_back is not None:
        _knock_back(model, optimizer, tokenizer, rng, probe, knock_back)
    model.eval()


def _knock_back(
    model: Qwen2ForCausalLM,
    optimizer: torch.optim.Optimizer,
    tokenizer: PreTrainedTokenizerFast,
    rng: random.Random,
    probe: tuple[torch.Tensor, torch.Tensor],
    knock_back: KnockBack,
) -> None:
    # The warm-up's optimizer goes on (its moments included), at the knock-back's rate.
    for group in optimizer.param_groups:
        group["lr"] = knock_back.lr
    for _ in range(knock_back.max_steps):
        if greedy_success(model, *probe) <= knock_back.to_success:
            return
        _train_step(model, optimizer, _supervised_batch(tokenizer, rng, knock_back.make_example))
    if greedy_success(model, *probe) > knock_back.to_success:
        raise RuntimeError(f"the knock-back did not bring greedy success down to {knock_back.to_success} in {knock_back.max_steps} steps")


def _train_step(model: Qwen2ForCausalLM, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    input_ids, labels = batch
    model(input_ids=input_ids, labels=labels).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def greedy_success(model: Qwen2ForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
    """The share of rows whose every trained token is the model's argmax given the ones before: the
    rows greedy decoding would reproduce whole."""
    model.eval()
    with torch.no_grad():
        predicted = model(input_ids=input_ids).logits[:, :-1].argmax(-1)
    model.train()
    targets = labels[:, 1:]
    return ((predicted == targets) | (targets == -100)).all(-1).float().mean().item()


def probe_batch(
    tokenizer: PreTrainedTokenizerFast, make_example: Example, seed: int = WARMUP_SEED, first_turn_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch a warm-up of ``seed`` measures its greedy success on (apart from its training stream)."""
    return _supervised_batch(tokenizer, random.Random(seed + 1), make_example, first_turn_only)


def _supervised_batch(
    tokenizer: PreTrainedTokenizerFast, rng: random.Random, make_example: Example, first_turn_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    rows: list[tuple[list[int], list[int]]] = []
    for _ in range(WARMUP_BATCH):
        prompt, answer = make_example(rng)
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        answer_ids, answer_labels = [], []
        segments = answer_segments(answer)
        for text, trained in segments[:1] if first_turn_only else segments:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            answer_ids += ids
            answer_labels += ids if trained else [-100] * len(ids)
        rows.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_labels))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for row, (ids, targets) in enumerate(rows):  # right padding: positions stay 0..n-1
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(targets)] = torch.tensor(targets)
    return input_ids, labels


def build_tiny_checkpoint(
    out_dir: str | Path,
    *,
    warmup: bool = True,
    make_example: Example = make_example,
    warmup_steps: int = WARMUP_STEPS,
    warmup_seed: int = WARMUP_SEED,
    added_tokens: tuple[str, ...] = (),
    first_turn_steps: int = 0,
    until_success: float | None = None,
    knock_back: KnockBack | None = None,
    moe: bool = False,
) -> Path:
    """Make, warm up and save the tiny model + tokenizer as an HF checkpoint folder; the bundled
    reverse task by default, or any task given as ``make_example`` (random.Random -> prompt, answer).
    ``moe``: the mixture-of-experts variant (``engine.tiny.moe``), with its own warm-up length."""
    from trellis.engine.tiny import moe as tiny_moe

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(make_example=make_example, added_tokens=added_tokens)
    model = tiny_moe.build_moe_model(tokenizer) if moe else build_model(tokenizer)
    if moe and warmup_steps == WARMUP_STEPS:
        warmup_steps = tiny_moe.WARMUP_STEPS
    if moe and warmup_seed == WARMUP_SEED:
        warmup_seed = tiny_moe.WARMUP_SEED
    if warmup:
        warm_up(
            model, tokenizer, warmup_seed, make_example=make_example, steps=warmup_steps, first_turn_steps=first_turn_steps,
            until_success=until_success, knock_back=knock_back,
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
