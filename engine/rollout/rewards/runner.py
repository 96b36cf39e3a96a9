"""Reward functions: any ``module:function`` or ``path/to/file.py:function`` (``engine.user_code``) that
takes the sample and returns a score.

The function receives one dict (``prompt`` messages, ``response`` text, ``label``, ``data_source``,
``task_name`` and the dataset's extra columns) and returns a number or a dict holding ``score``.
Functions run in separate processes: one that raises, returns garbage or runs past its timeout marks
its sample FAILED with the reason, and never crashes or hangs the step (the stuck process is killed).
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trellis.engine.config import RewardConfig
from trellis.engine.rollout.bounded_calls import BoundedCalls
from trellis.engine.secrets import redact
from trellis.engine.user_code import check_takes_one_argument, load_function


@dataclass(frozen=True)
class RewardResult:
    score: float | None
    payload: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    started_s: float | None = None  # wall clock of the call in its worker process (tracing); None when it failed there
    ended_s: float | None = None


def resolve_function(spec: str, base_dir: str | Path | None = None) -> Callable[[dict[str, Any]], Any]:
    """The reward function ``spec`` names (looked up from ``base_dir``, default the current
    directory), checked to take one argument; ``UserCodeError`` (a ``ValueError``) with a one-line
    reason otherwise."""
    function = load_function(spec, base_dir)
    check_takes_one_argument(spec, function, "a reward function")
    return function


def call_reward(spec: str, sample: dict[str, Any]) -> tuple[Any, float, float]:
    """Runs inside a pool process: import by name (cached by Python) and call; what it returned, and when
    the call started and ended."""
    function = resolve_function(spec)
    started = time.time()
    raw = function(sample)
    return raw, started, time.time()


def normalize(raw: Any) -> RewardResult:
    payload = raw if isinstance(raw, dict) else {"score": raw}
    score = payload.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return RewardResult(None, {}, f"reward function returned {raw!r}; expected a finite number or a dict with 'score'")
    return RewardResult(float(score), {**payload, "score": float(score)})


class RewardRunner:
    """Scores samples in a pool of worker processes, each call bounded by ``timeout_s``."""

    def __init__(self, config: RewardConfig) -> None:
        self._config = config
        for spec in (config.function, *config.by_data_source.values()):
            resolve_function(spec)  # fail at start-up, not mid-run, on a misspelt function
        # Reward code should not use torch threads: the workers are forked from this process.
        self._calls = BoundedCalls(config.num_workers, config.timeout_s)

    def score(self, samples: list[dict[str, Any]]) -> list[RewardResult]:
        """A batch's scores; calls that hang cost the batch about one ``timeout_s`` together."""
        futures = self._calls.map(call_reward, [(self._spec_for(sample), sample) for sample in samples])
        return [self._collect(future) for future in futures]

    def close(self) -> None:
        self._calls.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spec_for(self, sample: dict[str, Any]) -> str:
        return self._config.by_data_source.get(sample.get("data_source", ""), self._config.function)

    def _collect(self, future) -> RewardResult:
        try:
            raw, started, ended = future.result()
            return dataclasses.replace(normalize(raw), started_s=started, ended_s=ended)
        except FutureTimeout:
            return RewardResult(None, {}, f"reward function timed out after {self._config.timeout_s:g}s")
        except Exception as error:  # the user's function raised: keep the message, fail the sample only
            # The message lands in the trajectory lake: no credential the process knows of goes with it.
            return RewardResult(None, {}, redact(f"reward function raised {type(error).__name__}: {error}"))

