"""The bundled multi-turn task: look a key up with a tool, then answer with its value.

``lookup QWXZ`` -> the model calls ``lookup`` with ``{"key": "QWXZ"}``, reads the value (3 capital
letters drawn from a hash of the key, so no model can guess or memorise them) and answers it. The
reward is 1.0 only for the right value after a successful lookup of that key: answering without the
tool earns nothing.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from trellis.engine.tiny.files import write_rows

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
KEY_LENGTH = 4  # fixed, so each copied letter sits at one distance: what a ~1M model learns fast
DATA_SOURCE = "lookup"
EVAL_SEED_OFFSET = 2_000_003
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "{\"arguments\":{\"key\":\"", "\"},\"name\":\"lookup\"}")
IM_END = "<|im_end|>"
# The tool turn as the agent loop's default templates render it (Qwen's chat template).
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def value_of(key: str) -> str:
    digest = hashlib.sha256(key.encode()).digest()
    return "".join(ALPHABET[b % len(ALPHABET)] for b in digest[:3])


def lookup(key: str) -> str:
    """The task's tool."""
    if not isinstance(key, str) or not key.isalpha() or not key.isupper():
        return f"unknown key {key!r}: keys are capital letters"
    return value_of(key)


TOOLS = {"lookup": lookup}


def tool_call(key: str) -> str:
    # Arguments first (JSON objects are unordered): the key then sits a few tokens from the prompt's,
    # close enough for a ~1M model to learn to copy it.
    return "<tool_call>" + json.dumps({"arguments": {"key": key}, "name": "lookup"}, separators=(",", ":")) + "</tool_call>"


def make_example(rng: random.Random) -> tuple[str, list[tuple[str, bool]]]:
    """A prompt and its ideal session, as (text, trained) segments: the tool's output is not trained."""
    key = "".join(rng.choice(ALPHABET) for _ in range(KEY_LENGTH))
    return f"lookup {key}", [
        (tool_call(key) + IM_END, True),
        (TOOL_TURN.format(output=value_of(key)), False),
        (value_of(key) + IM_END, True),
    ]


def make_rows(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt, _ = make_example(rng)
        key = prompt.split()[-1]
        rows.append({"prompt": prompt, "label": value_of(key), "data_source": DATA_SOURCE, "task_name": "lookup", "key": key})
    return rows


def write_dataset(path: str | Path, count: int, seed: int) -> Path:
    return write_rows(path, make_rows(count, seed))


def score(sample: dict[str, Any]) -> float:
    """1.0 for the value of the prompt's key, answered after a successful lookup of that key."""
    looked_up = any(
        call["name"] == "lookup" and call["error"] is None and call["arguments"].get("key") == sample["key"]
        for call in sample.get("tool_calls", [])
    )
    return 1.0 if looked_up and str(sample["response"]).strip() == str(sample["label"]) else 0.0


# The warm-up runs until copying is learned: greedy success jumps from ~5% to ~90% within a few dozen
# steps, but where the jump falls moves with the machine's arithmetic (steps 141-146 on one CPU, ~310
# on an AMD EPYC; 231-703 over other warm-up seeds), and a model stopped inside it was left with half a
# skill that 30 RL steps finished on one machine and not on another. So it learns the skill whole, then
# a weak teacher's sessions knock its answers back to at most 35%: RL climbs the same way everywhere.
WARMUP_STEPS = 143
WARMUP_SUCCESS = 0.9
START_SUCCESS = 0.35
WEAK_TEACHER_BACKWARDS = 0.7  # the share of the weak teacher's answers that give the value backwards
FIRST_TURN_STEPS = 100  # the tool call alone first; then whole sessions


def weak_teacher_example(rng: random.Random) -> tuple[str, list[tuple[str, bool]]]:
    """A session of a teacher that looks the key up right but often answers its value backwards."""
    prompt, segments = make_example(rng)
    if rng.random() < WEAK_TEACHER_BACKWARDS:
        value = segments[-1][0].removesuffix(IM_END)
        segments = [*segments[:-1], (value[::-1] + IM_END, True)]
    return prompt, segments


def build_checkpoint(out_dir: str | Path, *, warmup: bool = True, warmup_seed: int | None = None) -> Path:
    """The tiny model and tokenizer warmed up on this task (``trellis tiny-model --task lookup``).
    ``warmup_seed``: another data stream than the default's (bench/lookup_warmup_seeds.py)."""
    from trellis.engine.tiny.model import WARMUP_SEED, KnockBack, build_tiny_checkpoint

    return build_tiny_checkpoint(
        out_dir, warmup=warmup, warmup_seed=WARMUP_SEED if warmup_seed is None else warmup_seed,
        make_example=make_example, warmup_steps=WARMUP_STEPS,
        first_turn_steps=FIRST_TURN_STEPS, added_tokens=ADDED_TOKENS, until_success=WARMUP_SUCCESS,
        knock_back=KnockBack(weak_teacher_example, to_success=START_SUCCESS),
    )
