"""The stability guard's rules (``guard:``): after a step's update, its metrics against bounds and against
the running medians of the steps that passed before it.

The guard lives with the controller and is part of its checkpoint, so a rollback or a resume restores the
history of the steps it goes back to. A step that passes joins the history; a tripped one does not.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from trellis.engine.config.guard import GuardConfig

GRAD_NORM, ENTROPY, REWARD, K3 = "train/grad_norm", "entropy/rollout", "response/rewards/mean", "mismatch/k3_kl"
_TRACKED = (GRAD_NORM, ENTROPY, REWARD)


@dataclass(frozen=True)
class Breach:
    """One rule that tripped: which, on which metric, the value and the bound it crossed."""

    rule: str
    metric: str
    value: float
    bound: float
    median: float | None = None  # the running median the bound came from, for the relative rules

    def sentence(self) -> str:
        against = f" (running median {self.median:.4g})" if self.median is not None else ""
        return f"{self.rule}: {self.metric} = {self.value:.4g}, bound {self.bound:.4g}{against}"


@dataclass(frozen=True)
class Trip:
    """A step the guard stopped: what tripped, on what metrics."""

    step: int
    breaches: tuple[Breach, ...]
    metrics: Mapping[str, float] = field(default_factory=dict)

    @property
    def rules(self) -> str:
        return ", ".join(breach.rule for breach in self.breaches)

    def summary(self) -> str:
        return "; ".join(breach.sentence() for breach in self.breaches)


class StabilityGuard:
    """The rules of ``config`` over each step's metrics, with the recent values of the steps that passed."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.history: dict[str, deque[float]] = {name: deque(maxlen=config.window) for name in _TRACKED}

    def check(self, step: int, metrics: Mapping[str, float]) -> Trip | None:
        """None when the step passes (its metrics then join the history), else the ``Trip``."""
        breaches = self.breaches(metrics)
        if breaches:
            return Trip(step, tuple(breaches), dict(metrics))
        for name, values in self.history.items():
            if name in metrics:
                values.append(float(metrics[name]))
        return None

    def breaches(self, metrics: Mapping[str, float]) -> list[Breach]:
        rules = self.config
        found: list[Breach] = []
        if rules.nonfinite:
            found += [Breach("nonfinite", name, value, math.inf) for name, value in sorted(metrics.items()) if not math.isfinite(value)]
        if rules.max_k3_mismatch is not None and metrics.get(K3, 0.0) > rules.max_k3_mismatch:
            found.append(Breach("k3_mismatch", K3, metrics[K3], rules.max_k3_mismatch))
        if (median := self._median(GRAD_NORM, metrics)) is not None and rules.grad_norm_spike is not None:
            if metrics[GRAD_NORM] > rules.grad_norm_spike * median and median > 0:
                found.append(Breach("grad_norm_spike", GRAD_NORM, metrics[GRAD_NORM], rules.grad_norm_spike * median, median))
        if (median := self._median(ENTROPY, metrics)) is not None and rules.entropy_collapse is not None:
            if metrics[ENTROPY] < rules.entropy_collapse * median:
                found.append(Breach("entropy_collapse", ENTROPY, metrics[ENTROPY], rules.entropy_collapse * median, median))
        if (median := self._median(REWARD, metrics)) is not None:
            if rules.reward_collapse is not None and median > 0 and metrics[REWARD] < rules.reward_collapse * median:
                found.append(Breach("reward_collapse", REWARD, metrics[REWARD], rules.reward_collapse * median, median))
            if rules.reward_drop is not None and metrics[REWARD] < median - rules.reward_drop:
                found.append(Breach("reward_drop", REWARD, metrics[REWARD], median - rules.reward_drop, median))
        return found

    def _median(self, name: str, metrics: Mapping[str, float]) -> float | None:
        """The running median of ``name`` once enough steps passed, if the step reports a finite value."""
        values = self.history[name]
        if len(values) < self.config.min_history or not math.isfinite(metrics.get(name, math.nan)):
            return None
        return statistics.median(values)

    def state_dict(self) -> dict[str, Any]:
        return {name: list(values) for name, values in self.history.items()}

    def load_state_dict(self, state: Mapping[str, list[float]]) -> None:
        for name, values in self.history.items():
            values.clear()
            values.extend(state.get(name, []))
