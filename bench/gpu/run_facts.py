"""What a bench reads back from a run's own files: the weights and prompts it started from (as short
digests, so two runs can be shown to have read the same ones) and the staleness of what it trained."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq


def caps_digest(path: Path) -> str:
    """A short digest of the prompts and response caps a run read: equal digests, equal length mix."""
    table = pq.read_table(path, columns=["prompt", "max_new_tokens"]).to_pylist()
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()[:12]


def weights_digest(model: Path) -> str:
    """A short digest of the weights a run started from."""
    return files_digest(sorted(model.glob("*.safetensors")))


def files_digest(paths: list[Path]) -> str:
    """A short digest of the bytes of ``paths``, in order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:12]


def staleness_histogram(run_uri: str) -> dict[str, dict[int, int]]:
    """Trained tokens and samples by staleness (train step - 1 - version of the token)."""
    tokens, samples = Counter(), Counter()
    for part in Path(run_uri, "trajectories", "split=train").glob("*/part-*.parquet"):
        table = pq.read_table(part, columns=["train_step", "response_versions"]).to_pylist()
        for row in table:
            ages = [row["train_step"] - 1 - v for v in row["response_versions"]]
            tokens.update(ages)
            samples[max(ages) if ages else 0] += 1
    return {"tokens": dict(sorted(tokens.items())), "samples_by_oldest_token": dict(sorted(samples.items()))}
