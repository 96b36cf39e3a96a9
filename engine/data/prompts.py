"""Prompt datasets: read Parquet or JSONL through fsspec, keep usable rows, count the rest.

A row needs a prompt (a string, or a list of ``{"role", "content"}`` messages). Its label, data
source and task name are optional, and so is ``max_new_tokens``, the prompt's own cap on response
tokens (below ``rollout.max_new_tokens``); every other column travels to the reward function as an extra.
Rows that cannot be used are skipped and counted by reason, never silently dropped.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pyarrow.parquet as pq

from trellis.engine.config import DatasetConfig
from trellis.engine.errors import SettingError

logger = logging.getLogger(__name__)

MAX_NEW_TOKENS_KEY = "max_new_tokens"


@dataclass(frozen=True)
class PromptRecord:
    index: int
    messages: tuple[dict[str, str], ...]
    prompt_ids: tuple[int, ...]
    label: Any = None
    data_source: str = "default"
    task_name: str = "default"
    extra: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None


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


class DatasetError(SettingError):
    """The dataset cannot be read at all (missing path, unknown format, no usable rows)."""


def load_prompts(config: DatasetConfig, tokenizer: Any) -> tuple[list[PromptRecord], SkipReport]:
    report = SkipReport()
    records: list[PromptRecord] = []
    for row in _read_rows(config, report):
        record = _to_record(row, config, tokenizer, report, index=report.rows_read - 1)
        if record is not None:
            records.append(record)
            if config.limit is not None and len(records) >= config.limit:
                break
    if report.skipped:
        logger.warning("Dataset %s: %s", config.path, report.summary())
    if not records:
        raise DatasetError(f"Dataset {config.path} has no usable rows: {report.summary()}")
    return records, report


def _read_rows(config: DatasetConfig, report: SkipReport):
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
        with fs.open(path, "rb") as handle:
            if file_format == "parquet":
                for batch in pq.ParquetFile(handle).iter_batches():
                    for row in batch.to_pylist():
                        report.rows_read += 1
                        yield row
            else:
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
    row: dict[str, Any], config: DatasetConfig, tokenizer: Any, report: SkipReport, index: int
) -> PromptRecord | None:
    prompt = row.get(config.prompt_key)
    messages = _as_messages(prompt)
    if messages is None:
        reason = "no prompt" if prompt in (None, "", []) else "prompt of wrong type"
        report.skip(reason, f"row {index}: {config.prompt_key}={str(prompt)[:40]!r}")
        return None
    prompt_ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
    )
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
    )


def _as_messages(prompt: Any) -> tuple[dict[str, str], ...] | None:
    if isinstance(prompt, str):
        return ({"role": "user", "content": prompt},) if prompt.strip() else None
    if isinstance(prompt, (list, tuple)) and prompt:
        messages = []
        for message in prompt:
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                return None
            if message.get("role") not in ("system", "user", "assistant", "tool"):
                return None
            messages.append({"role": message["role"], "content": message["content"]})
        return tuple(messages)
    return None
