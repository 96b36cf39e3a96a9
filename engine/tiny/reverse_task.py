"""The bundled task: reverse a word of 3-6 capital letters. ``reverse QWXZ`` -> ``ZXWQ``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from trellis.engine.tiny.files import write_rows

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DATA_SOURCE = "reverse"
EVAL_SEED_OFFSET = 1_000_003  # held-out prompts come from a separate random stream


def make_example(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 6)))
    return f"reverse {word}", word[::-1]


def make_rows(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt, answer = make_example(rng)
        rows.append({"prompt": prompt, "label": answer, "data_source": DATA_SOURCE, "task_name": "reverse"})
    return rows


def write_dataset(path: str | Path, count: int, seed: int) -> Path:
    """Write ``count`` prompts as Parquet (the format trellis reads by default)."""
    return write_rows(path, make_rows(count, seed))


def score(sample: dict[str, Any]) -> float:
    """1.0 iff the stripped response equals the reversed word."""
    return 1.0 if str(sample["response"]).strip() == str(sample["label"]) else 0.0


def partial_score(sample: dict[str, Any]) -> float:
    """Share of the reversed word's letters in the right place: a softer verifier, for ``rescore``."""
    response, label = str(sample["response"]).strip(), str(sample["label"])
    if not label:
        return 0.0
    return sum(a == b for a, b in zip(response, label)) / max(len(label), len(response))


def build_checkpoint(out_dir: str | Path, *, warmup: bool = True, moe: bool = False) -> Path:
    """The tiny model and tokenizer warmed up on this task (``trellis tiny-model``); ``moe``: its
    mixture-of-experts variant."""
    from trellis.engine.tiny.model import build_tiny_checkpoint

    return build_tiny_checkpoint(out_dir, warmup=warmup, moe=moe)
