"""Prompt datasets: read Parquet or JSONL through fsspec, keep usable rows, count the rest.

A row needs a prompt (a string, or a list of ``{"role", "content"}`` messages whose content is a
string or a list of text and image parts, ``engine.vision.images``). Its label, data
source and task name are optional, and so is ``max_new_tokens``, the prompt's own cap on response
tokens (below ``rollout.max_new_tokens``); every other column travels to the reward function as an extra.
Rows that cannot be used are skipped and counted by reason, never silently dropped.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fsspec

from trellis.engine.config import DatasetConfig
from trellis.engine.data.hf_datasets import hf_rows
from trellis.engine.errors import DatasetError
from trellis.engine.parquet_reads import iter_parquet_rows
from trellis.engine.vision.images import ImageError, PromptImage, image_sources, load_image
from trellis.engine.vision.processor import VisionProcessor

logger = logging.getLogger(__name__)

MAX_NEW_TOKENS_KEY = "max_new_tokens"


@dataclass(frozen=True)
class PromptRecord:
    index: int
    messages: tuple[dict[str, Any], ...]  # an image part's source replaced by its reference (uri or sha256:...)
    prompt_ids: tuple[int, ...]  # a vision-language prompt's with each image's placeholder expanded
    label: Any = None
    data_source: str = "default"
    task_name: str = "default"
    extra: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None
    images: tuple[PromptImage, ...] = ()  # in the order of the prompt's placeholders


@dataclass
class SkipReport:
    """How many rows were read and why the unusable ones were skipped."""

    rows_read: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)

    def skip(self, reason: str, example: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, example)

    @property
    def rows_used(self) -> int:
        return self.rows_read - sum(self.skipped.values())

    def summary(self) -> str:
        if not self.skipped:
            return f"{self.rows_read} rows read, all usable"
        parts = ", ".join(f"{count} {reason} (e.g. {self.examples[reason]})" for reason, count in self.skipped.items())
        return f"{self.rows_read} rows read, {self.rows_used} usable, skipped: {parts}"


__all__ = ["DatasetError", "PromptRecord", "SkipReport", "load_prompts"]


def load_prompts(
    config: DatasetConfig, tokenizer: Any, vision: VisionProcessor | None = None
) -> tuple[list[PromptRecord], SkipReport]:
    """``vision``: the policy's image processor (a vision-language policy); rows with images need it."""
    report = SkipReport()
    records: list[PromptRecord] = []
    for row in _read_rows(config, report):
        record = _to_record(row, config, tokenizer, vision, report, index=report.rows_read - 1)
        if record is not None:
            records.append(record)
            if config.sample_ratio is None and config.limit is not None and len(records) >= config.limit:
                break
    if config.sample_ratio is not None:
        drawn = random.Random(config.sample_seed).sample(range(len(records)), max(1, round(len(records) * config.sample_ratio)))
        records = [records[index] for index in sorted(drawn)][: config.limit]
    if report.skipped:
        logger.warning("Dataset %s: %s", config.source, report.summary())
    if not records:
        raise DatasetError(f"Dataset {config.source} has no usable rows: {report.summary()}")
    return records, report


def _read_rows(config: DatasetConfig, report: SkipReport):
    """The dataset's rows with ``config.columns`` renamed; a renamed column that is missing from the first
    row stops the read (a mapping that names no real column would otherwise skip every row as "no prompt")."""
    rows = hf_rows(config) if config.hf is not None else _file_rows(config, report)
    for position, row in enumerate(rows):
        if config.hf is not None:
            report.rows_read += 1
        if config.columns:
            if position == 0 and (missing := [c for c in config.columns if c not in row]):
                raise DatasetError(f"{config.source}: columns names {missing}, not among the dataset's columns {sorted(row)}")
            row = {config.columns.get(key, key): value for key, value in row.items()}
        yield row


def _file_rows(config: DatasetConfig, report: SkipReport):
    fs, root = fsspec.core.url_to_fs(config.path, **config.storage_options)
    if not fs.exists(root):
        raise DatasetError(f"Dataset path does not exist: {config.path}")
    files = sorted(f for f in fs.find(root) if _format_of(f, config) is not None) if fs.isdir(root) else [root]
    if not files:
        raise DatasetError(f"Dataset folder {config.path} holds no .parquet or .jsonl files.")
    for path in files:
        file_format = _format_of(path, config)
        if file_format is None:
            raise DatasetError(f"Cannot tell the format of {path}: use .parquet or .jsonl, or set format.")
        if file_format == "jsonl":
            yield from _jsonl_rows(fs, path, report)
            continue
        for row in iter_parquet_rows(fs, path):
            report.rows_read += 1
            yield row


def _jsonl_rows(fs, path: str, report: SkipReport):
    """The objects of a JSONL file; a line that is not one is skipped with its reason (it still counts as read)."""
    with fs.open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            report.rows_read += 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                report.skip("invalid JSON", f"{path}:{line_number}: {error.msg}")
                continue
            if not isinstance(row, dict):
                report.skip("not an object", f"{path}:{line_number}")
                continue
            yield row


def _format_of(path: str, config: DatasetConfig) -> str | None:
    if config.format != "auto":
        return config.format
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith((".jsonl", ".json")):
        return "jsonl"
    return None


def _to_record(
    row: dict[str, Any], config: DatasetConfig, tokenizer: Any, vision: VisionProcessor | None, report: SkipReport, index: int
) -> PromptRecord | None:
    prompt = row.get(config.prompt_key)
    messages = _as_messages(prompt)
    if messages is None:
        reason = "no prompt" if prompt in (None, "", []) else "prompt of wrong type"
        report.skip(reason, f"row {index}: {config.prompt_key}={str(prompt)[:40]!r}")
        return None
    images: tuple[PromptImage, ...] = ()
    if sources := image_sources(messages):
        if vision is None:
            raise DatasetError(
                f"Row {index} of {config.source} holds images, and the policy is a text-only model: "
                "train a vision-language model (Qwen2-VL family) on it, or drop the image parts."
            )
        try:
            loaded = [load_image(s, max_pixels=config.max_image_pixels, storage_options=config.storage_options) for s in sources]
        except ImageError as error:
            report.skip(error.reason, f"row {index}: {error}")
            return None
        images = tuple(image for _, image in loaded)
        messages = _with_image_refs(messages, images)
    prompt_ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if images:
        try:
            prompt_ids = vision.expand(prompt_ids, vision.grids([pixels for pixels, _ in loaded]))
        except ValueError as error:
            report.skip("images and placeholders differ", f"row {index}: {error}")
            return None
    if len(prompt_ids) > config.max_prompt_length:
        report.skip("prompt too long", f"row {index}: {len(prompt_ids)} > {config.max_prompt_length} tokens")
        return None
    max_new_tokens = row.get(MAX_NEW_TOKENS_KEY)
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1):
        report.skip(f"bad {MAX_NEW_TOKENS_KEY}", f"row {index}: {MAX_NEW_TOKENS_KEY}={max_new_tokens!r} is not a positive integer")
        return None
    known = {config.prompt_key, config.label_key, config.data_source_key, config.task_name_key, MAX_NEW_TOKENS_KEY}
    return PromptRecord(
        index=index,
        messages=messages,
        prompt_ids=tuple(int(i) for i in prompt_ids),
        label=row.get(config.label_key),
        data_source=str(row.get(config.data_source_key) or "default"),
        task_name=str(row.get(config.task_name_key) or "default"),
        extra={k: v for k, v in row.items() if k not in known},
        max_new_tokens=max_new_tokens,
        images=images,
    )


def _as_messages(prompt: Any) -> tuple[dict[str, Any], ...] | None:
    if isinstance(prompt, str):
        return ({"role": "user", "content": prompt},) if prompt.strip() else None
    if isinstance(prompt, (list, tuple)) and prompt:
        messages = []
        for message in prompt:
            if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
                return None
            content = message.get("content")
            if isinstance(content, (list, tuple)) and content and all(map(_is_part, content)):
                # Text parts alone read as one string, which every chat template renders.
                texts = [part["text"] for part in content if part["type"] == "text"]
                content = "".join(texts) if len(texts) == len(content) else [dict(part) for part in content]
            elif not isinstance(content, str):
                return None
            messages.append({"role": message["role"], "content": content})
        return tuple(messages)
    return None


def _is_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    return (part.get("type") == "text" and isinstance(part.get("text"), str)) or part.get("type") == "image"


def _with_image_refs(messages: tuple[dict[str, Any], ...], images: tuple[PromptImage, ...]) -> tuple[dict[str, Any], ...]:
    """The messages with each image part's source (bytes, often) replaced by a reference to it."""
    refs = iter(image.ref.uri or f"sha256:{image.ref.sha256}" for image in images)
    return tuple(
        {**m, "content": [{"type": "image", "image": next(refs)} if p["type"] == "image" else p for p in m["content"]]}
        if isinstance(m["content"], list) else m
        for m in messages
    )
