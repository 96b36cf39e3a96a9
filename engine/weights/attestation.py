"""Attested weight syncs: after every sync, before any rollout uses the new weights, each engine shows
that it holds the trainer's. Two checks:

- content: exact checksums of the bytes every bucket carried (``bucket_checksums``), taken by the
  trainer over what it sent and by each engine over what it received, before loading it. A transport
  that dropped, reordered or garbled bytes is caught here, to the bucket.
- canary: the logprobs of a fixed text's tokens at temperature 1, from the trainer and from each
  engine (a forward on each side, no sampling). An engine that received the right bytes but serves
  something else (a load that did not happen, a wrong layout, weights left asleep) is caught here,
  within a tolerance that follows the engine's precision.

An engine that took weights in is *held* (``WeightIntake``): it refuses to generate until the run
admits the version, which only a passed attestation does. A failed attestation syncs again
(``attest.sync_retries``), then fails the step (``WeightAttestationError``, with a page for the run's
artifacts). Both ``Workers`` implementations run the same ``engine.run.attested_sync``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from trellis.engine.config import TrellisConfig
from trellis.engine.devices import rollout_device
from trellis.engine.faults import fault_flag
from trellis.engine.weights.buckets import BUCKET_BYTES

_STRIDE = 1021  # a prime: a move of whole tensors by a power of two is never a multiple of it
_CHUNK_WORDS = _STRIDE << 14  # words widened to int64 at a time: 128 MB of scratch on the device at most

# The two test hooks (``engine.faults``): bytes flipped in what an engine received, before its checksum
# (a garbled transport), or after it, in what it loads (an engine that serves something else).
CORRUPT_RECEIVED = "rollout.corrupt_received"
CORRUPT_APPLIED = "rollout.corrupt_applied"


# -- content: the bytes of each bucket ---------------------------------------------------------------


@dataclass(frozen=True)
class BucketSum:
    """Exact sums over a bucket's bytes: plain, and weighted by position (which sees moved bytes)."""

    first: str  # the bucket's first and last tensor, to name it
    last: str
    tensors: int
    bytes: int
    total: int
    weighted: int


def bucket_checksums(weights: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> tuple[BucketSum, ...]:
    """The tensors in order, cut into buckets of about ``bucket_bytes``; integer sums, so a GPU and a CPU,
    or two orders of addition, agree to the last bit. Each tensor is read as words (``_words``); a
    bucket's sums run over its words in order, a word weighted by its position."""
    sums: list[BucketSum] = []
    bucket = _Bucket()
    for name, tensor in weights.items():
        data = _words(tensor)
        nbytes = data.numel() * data.element_size()
        if bucket.names and bucket.size + nbytes > bucket_bytes:
            sums.append(bucket.close())
            bucket = _Bucket()
        bucket.add(name, data, nbytes)
    if bucket.names:
        sums.append(bucket.close())
    return tuple(sums)


class _Bucket:
    """Sums a bucket's words as they come. Runs of small tensors of one word width are joined before
    summing (the same words in the same order, so the same sums), which saves a pass per tensor."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.size = self.words = self.total = self.weighted = 0
        self._pending: list[torch.Tensor] = []

    def add(self, name: str, data: torch.Tensor, nbytes: int) -> None:
        if self._pending and (self._pending[0].dtype != data.dtype or sum(t.numel() for t in self._pending) + data.numel() > _CHUNK_WORDS):
            self._flush()
        self._pending.append(data)
        self.names.append(name)
        self.size += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)
        total, weighted = _word_sums(data, offset=self.words)
        self.total, self.weighted, self.words = self.total + total, self.weighted + weighted, self.words + data.numel()
        self._pending = []

    def close(self) -> BucketSum:
        self._flush()
        return BucketSum(self.names[0], self.names[-1], len(self.names), self.size, self.total, self.weighted)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat run of the widest integers their count divides into (4, 2 or 1
    bytes): the width follows the size alone, so both sides read a tensor alike wherever it lies."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    for dtype in (torch.int32, torch.int16):
        if data.numel() % dtype.itemsize == 0:
            if data.storage_offset() % dtype.itemsize:  # a view into a bucket at an odd place
                data = data.clone()
            return data.view(dtype)
    return data


def _word_sums(data: torch.Tensor, offset: int) -> tuple[int, int]:
    """The sum of the words, and their sum weighted by position in the bucket (``offset`` on), mod
    ``_STRIDE``: a word's weight is ((offset + i) mod _STRIDE) + 1, so the weighted sum is the columns of
    a [rows, _STRIDE] view summed, then weighted (one pass over the data). int64 sums wrap alike everywhere."""
    total = weighted = 0
    weights = (torch.arange(_STRIDE, device=data.device, dtype=torch.int64) + offset) % _STRIDE + 1
    for start in range(0, data.numel(), _CHUNK_WORDS):
        chunk = data[start : start + _CHUNK_WORDS].to(torch.int64)
        whole = chunk.numel() - chunk.numel() % _STRIDE
        columns = chunk[:whole].view(-1, _STRIDE).sum(0)
        tail = chunk[whole:]
        # The chunk starts at a multiple of _STRIDE words (the chunk size is one), so its columns line up.
        total += int(columns.sum()) + int(tail.sum())
        weighted += int((columns * weights).sum()) + int((tail * weights[: tail.numel()]).sum())
    return total, weighted


def checksum_differences(sent: Sequence[BucketSum], received: Sequence[BucketSum]) -> list[str]:
    """The buckets whose bytes differ, in words; empty when every bucket arrived as sent."""
    if len(sent) != len(received):
        return [f"{len(received)} buckets arrived of {len(sent)} sent"]
    return [
        f"bucket {index} ({mine.first} .. {mine.last}, {mine.tensors} tensors, {mine.bytes} bytes)"
        for index, (mine, theirs) in enumerate(zip(sent, received))
        if mine != theirs
    ]


def flipped_if_asked(weights: Mapping[str, torch.Tensor], point: str) -> Mapping[str, torch.Tensor]:
    """Test hook: at a fault ``point`` that fires, the floating tensors of the first bucket come back
    with every byte flipped (copies: the sender's tensors, which may be these very objects in one
    process, stay whole)."""
    if not fault_flag(point):
        return weights
    weights, size = dict(weights), 0
    for index, (name, tensor) in enumerate(list(weights.items())):
        size += tensor.numel() * tensor.element_size()
        if index and size > BUCKET_BYTES:
            break
        if tensor.is_floating_point():
            flipped = tensor.detach().clone().contiguous()
            flipped.view(-1).view(torch.uint8).bitwise_not_()
            weights[name] = flipped
    return weights


# -- what an engine took in ----------------------------------------------------------------------------


class UnattestedWeightsError(RuntimeError):
    """An engine was asked to generate with weights the run has not attested."""


@dataclass
class WeightIntake:
    """An engine's record of the weights it took in: the checksums of what arrived, and whether the run
    has admitted them (until then the engine refuses to generate)."""

    policy_version: int = 0
    received: tuple[BucketSum, ...] = ()
    held: bool = False

    def arrive(self, weights: Mapping[str, torch.Tensor], policy_version: int, *, attested: bool) -> Mapping[str, torch.Tensor]:
        """Record what arrived (when the run attests its syncs) and hold the version until admitted;
        returns the weights to load."""
        weights = flipped_if_asked(weights, CORRUPT_RECEIVED)
        self.policy_version = policy_version
        if attested:
            self.received = bucket_checksums(weights)
            self.held = True
        return flipped_if_asked(weights, CORRUPT_APPLIED)

    def admit(self) -> None:
        self.held = False

    def refuse_if_held(self) -> None:
        if self.held:
            raise UnattestedWeightsError(
                f"This engine holds the weights of step {self.policy_version}, which are not attested yet; a rollout "
                "waits for the run's attestation of the sync (attest.enabled)."
            )


# -- canary: the same tokens scored on both sides --------------------------------------------------------


@dataclass(frozen=True)
class CanaryDifference:
    mean: float  # of |trainer - engine| over the canary's tokens
    max: float


def canary_difference(trainer: Sequence[float], engine: Sequence[float]) -> CanaryDifference:
    """A NaN, an infinity or another length is an infinite difference."""
    if len(trainer) != len(engine) or not trainer:
        return CanaryDifference(math.inf, math.inf)
    gaps = [abs(a - b) for a, b in zip(trainer, engine)]
    if not all(math.isfinite(gap) for gap in gaps):
        return CanaryDifference(math.inf, math.inf)
    return CanaryDifference(sum(gaps) / len(gaps), max(gaps))


# -- one attestation, and the sync it guards -------------------------------------------------------------


@dataclass(frozen=True)
class EngineEvidence:
    """What one engine shows after a sync: the checksums of what it received, its canary logprobs."""

    policy_version: int
    received: tuple[BucketSum, ...]
    canary: list[float]


@dataclass(frozen=True)
class TrainerEvidence:
    sent: tuple[BucketSum, ...]
    canary: list[float]


@dataclass
class Attestation:
    """The verdict on one sync: per engine, what failed (empty: attested)."""

    policy_version: int
    tolerance: float
    differences: list[CanaryDifference] = field(default_factory=list)
    failures: dict[int, list[str]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures

    def markdown(self, attempts: int) -> str:
        lines = [
            f"# Weight attestation failed: step {self.policy_version}",
            "",
            f"After {attempts} sync{'s' if attempts > 1 else ''}, these rollout engines do not hold the trainer's weights "
            f"(canary tolerance: mean |logprob difference| <= {self.tolerance:g}). No rollout used them.",
            "",
            "| engine | what failed |",
            "| --- | --- |",
        ]
        lines += [f"| {engine} | {'; '.join(reasons)} |" for engine, reasons in sorted(self.failures.items())]
        return "\n".join(lines) + "\n"


def attest(trainer: TrainerEvidence, engines: Sequence[EngineEvidence], policy_version: int, tolerance: float) -> Attestation:
    verdict = Attestation(policy_version, tolerance)
    for index, engine in enumerate(engines):
        reasons = []
        if engine.policy_version != policy_version:
            reasons.append(f"it serves step {engine.policy_version}")
        if wrong := checksum_differences(trainer.sent, engine.received):
            reasons.append("bytes differ from those sent in " + ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""))
        difference = canary_difference(trainer.canary, engine.canary)
        verdict.differences.append(difference)
        if not difference.mean <= tolerance:
            reasons.append(f"canary logprobs differ by {difference.mean:.3g} on average (max {difference.max:.3g})")
        if reasons:
            verdict.failures[index] = reasons
    return verdict


class WeightAttestationError(RuntimeError):
    """The rollout engines do not hold the trainer's weights after every sync allowed; ``page`` is the
    markdown the flow publishes as an artifact."""

    def __init__(self, verdict: Attestation, attempts: int) -> None:
        worst = "; ".join(f"rollout engine {engine}: {', '.join(reasons)}" for engine, reasons in sorted(verdict.failures.items()))
        super().__init__(
            f"The weight sync of step {verdict.policy_version} failed its attestation {attempts} times: {worst}. "
            "No rollout used these weights. Check the transport (cluster.weight_sync) and the engine's log; "
            "attest.canary_tolerance sets how far the canary may drift."
        )
        self.page = verdict.markdown(attempts)


def trainer_evidence(trainer: Any, token_ids: list[int]) -> TrainerEvidence:
    """On a trainer rank (every rank scores: the forward of a sharded model is collective)."""
    return TrainerEvidence(trainer.sent_checksums, trainer.canary_logprobs(token_ids))


def engine_evidence(engine: Any, token_ids: list[int]) -> EngineEvidence:
    intake = engine.intake
    return EngineEvidence(intake.policy_version, intake.received, engine.score_tokens(token_ids))


def admit(engine: Any) -> None:
    engine.intake.admit()


def held(engine: Any) -> bool:
    """Whether the engine waits for an attestation it never got (its sync's step failed)."""
    return engine.intake.held


CANARY_TOKENS = 32  # enough to see a wrong model; each more costs both sides a little forward


def canary_tokens(controller: Any, text: str) -> list[int]:
    return list(controller.tokenizer(text, add_special_tokens=False).input_ids)[:CANARY_TOKENS]


def attests(config: TrellisConfig) -> bool:
    """``attest.enabled``; unset: where the rollout runs on an accelerator. There the failures it catches
    live (sleep and wake-up, CUDA IPC, NCCL, vLLM's weight loader) and a step lasts seconds; on CPU the
    weights travel as whole tensors into transformers' own loader, and on the bundled tiny task the
    check cost 14% of a 0.55-0.87 s flow step (median of 4 alternated rounds; bench/attest_cost.py)."""
    enabled = config.attest.enabled
    return rollout_device(config).type != "cpu" if enabled is None else enabled


def canary_tolerance(config: TrellisConfig) -> float:
    """``attest.canary_tolerance``, else what the engine's precision allows (its docstring says)."""
    if config.attest.canary_tolerance is not None:
        return config.attest.canary_tolerance
    if config.rollout.quantization != "none":
        return 0.3
    return 0.1 if rollout_device(config).type == "cuda" else 1e-3
