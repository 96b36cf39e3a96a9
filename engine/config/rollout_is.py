"""The ``loss.rollout_is:`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trellis.engine.config.base import Frozen


class RolloutISConfig(Frozen):
    """Importance-sampling correction for the train/rollout policy mismatch (XTuner's rollout IS)."""

    level: Literal["none", "token", "sequence", "geometric"] = Field(
        "none", description="The ratio pi_train / pi_rollout per token, per sequence (the product of its tokens' ratios), "
        "or geometric (per sequence, the geometric mean of its tokens' ratios: the length does not compound it); none: no correction.",
    )
    mode: Literal["truncate", "mask", "both"] = Field(
        "truncate", description="truncate: cap the ratio at upper; mask: drop what lies outside [mask_lower, mask_upper]; "
        "both: drop outside the mask bounds, then cap what is kept at upper.",
    )
    upper: float = Field(2.0, gt=1.0, description="Upper bound of the importance ratio (truncate, both; and mask's default).")
    lower: float | None = Field(None, gt=0.0, lt=1.0, description="Lower bound for masking; default 1/upper.")
    mask_upper: float | None = Field(None, gt=1.0, description="Upper mask bound, when it differs from upper (e.g. truncate at 2, drop past 5).")
    mask_lower: float | None = Field(None, gt=0.0, lt=1.0, description="Lower mask bound; default lower.")
    veto_threshold: float | None = Field(
        None, gt=0.0, lt=1.0, description="Drop a whole sequence when any of its tokens has a ratio below this (a catastrophic "
        "outlier, e.g. 1e-4), at every level and mode; null: no veto.",
    )
