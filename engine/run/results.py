"""What the phases of a step hand each other and the orchestrator: small typed values. Samples, prepared
sequences and tensors stay with the workers (the controller keeps its batches by step); only the
prepared batch travels, from the controller to the trainer, as an object-store reference on a cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from trellis.engine.run.metrics import RunCounters

T = TypeVar("T", covariant=True)


class Pending(Protocol[T]):
    """A phase that runs beside the following ones; ``result`` waits for it."""

    def result(self) -> T: ...


@dataclass(frozen=True)
class Done(Generic[T]):
    """A phase that already ran (the in-process runner writes its trajectories at once)."""

    value: T

    def result(self) -> T:
        return self.value


@dataclass(frozen=True)
class BatchHandle:
    """A step's batch as the orchestrator sees it; the samples stay with the controller, kept under ``step``.

    ``ready`` False: the replay buffer had no batch yet (ask again). ``expired`` with nothing ``produced``:
    the producer waits for weights the trainer already has (sync them and run the step again)."""

    step: int
    ready: bool = True
    produced: int = 0  # samples produced for it
    expired: bool = False
    launched_s: float = math.inf  # wall time its rollout was launched, perhaps during the previous step
    metrics: dict[str, float] = field(default_factory=dict)  # produce_time_s, trajectory/*, async/*... for the step's metrics
    # With trace.samples: (rollout_id, what, wall start, wall end, attributes) of each sample's generation,
    # agent turns and reward, for engine.run.tracing's spans
    sample_spans: tuple[tuple[str, str, float, float, dict], ...] = ()

    @property
    def waits_for_weights(self) -> bool:
        return self.expired and not self.produced


@dataclass(frozen=True)
class Prepared:
    info: dict[str, float]  # response/* statistics and the training sample and token counts
    sequences: Any  # the PreparedBatch, or an object-store reference to it: what the trainer ranks fit


@dataclass(frozen=True)
class Evaluation:
    uri: str  # where the evaluation's trajectories landed ("" when not recorded)
    metrics: dict[str, float]


@dataclass(frozen=True)
class Logged:
    metrics: dict[str, float]
    counters: RunCounters


@dataclass(frozen=True)
class StepOutcome:
    step: int
    metrics: dict[str, float]
    counters: RunCounters
    phases: tuple[str, ...]  # the phases that ran, in their order
    advanced: bool = True  # False: no training happened (an expired batch); the step is run again
    rolled_back_to: int | None = None  # the stability guard set this step aside: the run goes on after that step
