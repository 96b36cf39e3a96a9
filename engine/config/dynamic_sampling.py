"""The ``dynamic_sampling:`` section."""

from __future__ import annotations

from pydantic import Field

from trellis.engine.config.base import Frozen


class DynamicSamplingConfig(Frozen):
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero advantage under a group
    baseline and teaches nothing, so it is dropped (FILTERED, kept in the lake) and more prompts are
    sampled until the step has ``train_batch_size`` groups with a reward spread."""

    enable: bool = Field(False, description="Drop groups whose rewards are all equal and sample more prompts.")
    max_rounds: int = Field(
        8, ge=1, description="Generation rounds per step, the first included; a batch still short after them trains on what it has."
    )
    group_filter: str | None = Field(
        None, description="Your own filter, 'module:function' (shipped like reward code): called with a scored group's "
        "samples (each a dict as a reward function sees it, plus its 'reward'), True keeps the group for training. A "
        "dropped group is FILTERED with the function's name; with enable, more prompts replace it. A filter that raises "
        "keeps the group and says so in a warning.",
    )
