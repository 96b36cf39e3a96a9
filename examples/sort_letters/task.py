"""The example's task: sort the letters of a word alphabetically. ``sort QWXZ`` -> ``QWXZ``, ``sort DBA`` -> ``ABD``."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def make_example(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 5)))
    return f"sort {word}", "".join(sorted(word))


def write_prompts(path: Path, count: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt, answer = make_example(rng)
        rows.append({"prompt": prompt, "answer": answer, "data_source": "sort"})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
