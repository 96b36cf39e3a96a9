"""The user's own hooks around a step, named ``module:function`` in the config and shipped like reward
code: a group filter (``dynamic_sampling.group_filter``) and an evaluation metric (``eval_metric``).
Each is called with samples as dicts (what a reward function sees, plus ``reward``). A hook that
raises loses nothing: the group is kept, the metric left out, and a warning says why."""

from __future__ import annotations

import logging
import math
from typing import Any

from trellis.engine.config.dynamic_sampling import DynamicSamplingConfig
from trellis.engine.data.samples import RolloutSample
from trellis.engine.user_code import load_function

logger = logging.getLogger(__name__)

Group = list[RolloutSample]


def as_dicts(group: Group) -> list[dict[str, Any]]:
    return [{**sample.reward_input(), "reward": sample.reward} for sample in group]


class GroupFilter:
    """The user's ``dynamic_sampling.group_filter``: called with a scored group's samples as dicts (a reward
    function's input, plus ``reward``); False drops the group."""

    def __init__(self, spec: str) -> None:
        self.spec, self._keep = spec, load_function(spec)

    @classmethod
    def of(cls, config: DynamicSamplingConfig) -> GroupFilter | None:
        return cls(config.group_filter) if config.group_filter else None

    def drops(self, group: Group) -> bool:
        try:
            return not self._keep(as_dicts(group))
        except Exception as error:  # the user's bug must not lose the group: it is kept, and the run says so
            logger.warning("dynamic_sampling.group_filter %s raised %s: %s; the group is kept.", self.spec, type(error).__name__, error)
            return False



class EvalMetric:
    """The user's ``eval_metric``: called with every evaluation group, it returns ``{name: number}``."""

    def __init__(self, spec: str) -> None:
        self.spec, self._measure = spec, load_function(spec)

    @classmethod
    def of(cls, spec: str | None) -> EvalMetric | None:
        return cls(spec) if spec else None

    def __call__(self, groups: list[Group]) -> dict[str, float]:
        try:
            found = self._measure([as_dicts(group) for group in groups])
        except Exception as error:
            logger.warning("eval_metric %s raised %s: %s; its figures are left out of this evaluation.", self.spec, type(error).__name__, error)
            return {}
        if not isinstance(found, dict):
            logger.warning("eval_metric %s returned a %s, not {name: number}; left out.", self.spec, type(found).__name__)
            return {}
        metrics = {}
        for name, value in found.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                metrics[str(name)] = float(value)
            else:
                logger.warning("eval_metric %s: %r is %r, not a finite number; left out.", self.spec, name, value)
        return metrics
