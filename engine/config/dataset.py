"""The ``train_dataset:`` / ``eval_dataset:`` sections: where prompts come from (``engine.data.prompts``)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from trellis.engine.config.base import Frozen, Location, StorageOptions


def _absolute_if_local_path(name: str | None) -> str | None:
    """A local dataset folder or file, made absolute as a Location is; a hub name stays as it is."""
    if name is not None and "://" not in name and os.path.exists(os.path.expanduser(name)):
        return os.path.abspath(os.path.expanduser(name))
    return name


class DatasetConfig(Frozen):
    """A prompt dataset: Parquet or JSONL files (local or any fsspec URI), or a Hugging Face dataset."""

    path: Location | None = Field(None, description="File or folder (Parquet / JSONL), local path or fsspec URI.")
    hf: str | None = Field(
        None, description="Instead of path: a Hugging Face dataset read with the datasets library: a local folder "
        "(save_to_disk's, or one of data files), a data file (.parquet, .jsonl, .json, .csv), or a hub name where a hub "
        "is reachable (e.g. openai/gsm8k).",
    )
    hf_subset: str | None = Field(None, description="hf: the dataset's configuration (gsm8k's main or socratic).")
    split: str = Field("train", description="hf: the split to read.")
    columns: dict[str, str] = Field(
        default_factory=dict, description="Columns renamed before reading, {dataset column: name}, e.g. "
        "{question: prompt, answer: label}; a missing column is an error.",
    )
    format: Literal["auto", "parquet", "jsonl"] = Field("auto", description="auto: from the file extension.")
    prompt_key: str = Field(
        "prompt",
        description="Column of the prompt: a string, or a list of {role, content} messages; a content may be a list of "
        '{"type": "text", "text": ...} and {"type": "image", "image": bytes, path or URI} parts (a vision-language policy).',
    )
    label_key: str = Field("label", description="Column of the label the reward function compares with (optional).")
    data_source_key: str = Field("data_source", description="Column that groups evaluation metrics and picks reward.by_data_source (optional).")
    task_name_key: str = Field("task_name", description="Column of the task name (optional).")
    max_prompt_length: int = Field(
        1024, gt=0, description="Prompts longer than this many tokens (after the chat template) are skipped and counted."
    )
    max_image_pixels: int = Field(
        4096 * 4096, gt=0, description="Rows with a larger image (width x height) are skipped and counted."
    )
    storage_options: StorageOptions = Field(default_factory=dict, repr=False, description="Passed to fsspec (e.g. S3 endpoint).")
    limit: int | None = Field(None, gt=0, description="Read only the first N usable rows (evaluation sets); after sample_ratio.")
    sample_ratio: float | None = Field(
        None, gt=0.0, le=1.0, description="Keep this share of the usable rows, drawn at random with sample_seed (evaluation "
        "sets: the same rows at every evaluation and in every run with the same seed), in their order.",
    )
    sample_seed: int = Field(0, description="Seed of sample_ratio's draw.")

    _hf_local = field_validator("hf")(_absolute_if_local_path)

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if (self.path is None) == (self.hf is None):
            raise ValueError("set exactly one of path (Parquet / JSONL files) and hf (a Hugging Face dataset)")
        return self

    @property
    def source(self) -> str:
        """Where the rows come from, for messages: the path, or ``hf:NAME[split]``."""
        return self.path if self.path is not None else f"hf:{self.hf}[{self.split}]"
