"""Evaluation: accuracy and pass@k per data source and per task on a held-out prompt set.

Any sample with a ``status``, a ``reward``, a ``data_source`` and a ``task_name`` will do (``RolloutSample`` has them),
so these functions need nothing from the rest of the engine.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Protocol, Sequence


class ScoredSample(Protocol):
    status: str  # "completed" when generated and scored
    reward: float | None
    data_source: str
    task_name: str


COMPLETED, FAILED = "completed", "failed"


def pass_at_k_estimate(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if samples - correct < k:
        return 1.0
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def evaluation_metrics(groups: Sequence[Sequence[ScoredSample]], *, k: int, threshold: float = 0.5) -> dict[str, float]:
    """``accuracy`` (mean of correct samples), ``pass@k`` and ``failed`` overall, per data source and per task."""
    metrics = _metrics_of(groups, k, threshold)
    for attribute in ("data_source", "task_name"):  # a name both a source and a task keeps the source's figures
        by_value: dict[str, list[Sequence[ScoredSample]]] = defaultdict(list)
        for group in groups:
            by_value[getattr(group[0], attribute)].append(group)
        if len(by_value) > 1:
            for value, value_groups in sorted(by_value.items()):
                for key, figure in _metrics_of(value_groups, k, threshold).items():
                    metrics.setdefault(f"{value}/{key}", figure)
    return metrics


def _metrics_of(groups: Sequence[Sequence[ScoredSample]], k: int, threshold: float) -> dict[str, float]:
    samples = [s for group in groups for s in group]
    correct = [s.status == COMPLETED and (s.reward or 0.0) > threshold for s in samples]
    metrics = {
        "accuracy": sum(correct) / max(1, len(samples)),
        "failed": float(sum(s.status == FAILED for s in samples)),
        "samples": float(len(samples)),
    }
    group_size = len(groups[0]) if groups else 0
    if group_size >= k > 1:
        scores = []
        for group in groups:
            right = sum(s.status == COMPLETED and (s.reward or 0.0) > threshold for s in group)
            scores.append(pass_at_k_estimate(len(group), right, k))
        metrics[f"pass@{k}"] = sum(scores) / len(scores)
    return metrics
