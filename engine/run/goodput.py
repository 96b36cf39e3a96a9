"""Goodput: where a step's device-seconds went, and the share that made trained tokens.

A step holds its devices for ``time/step`` seconds: the trainer's and the rollout's, once each where
they share them (colocated), both where each side has its own (disaggregated). That budget splits into

- ``trained_tokens``: generating the responses the step trained on, and training on them (``fit``);
- ``discarded/<why>``: generating responses thrown away: ``filtered`` by dynamic sampling, ``failed``
  (a reward or generation error spoiled the group), ``invalid`` (aborted, empty), ``truncated``
  (cut at the budget and masked out), in the asynchronous trainer ``expired`` (too stale, to be
  generated again) and ``given_up``, ``aborted`` (colocated over-sampling without partial rollout: stopped
  once the batch was full, to start again from the prompt), and ``rolled_back``: every device-second of the steps the
  stability guard set aside, counted in the first step logged after the rollback;
- ``other_generation``: generated in this step's window but neither trained nor thrown away in it
  (the asynchronous trainer's groups waiting for a later step, dynamic sampling's surplus);
- ``sync`` and ``attest``: the weight sync and its attestation, with every device waiting on them;
- ``idle``: the rest (waiting for a batch, evaluation, checkpoints, the orchestrator's own calls).

Generation is priced per token: the rollout's device-seconds (its wall time over its devices) over
the tokens it generated in the step's window. Per step this is approximate where windows overlap (the
asynchronous trainer trains tokens generated in an earlier window); summed over a run it is exact.
``goodput/percent`` is ``trained_tokens`` over the whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from trellis.engine.storage.lake_query import GOODPUT_PREFIX

if TYPE_CHECKING:
    from trellis.engine.run.metrics import RunDevices

# Tokens thrown away, by why: (the step metric that counts them, the category).
DISCARDED = {
    "response/discarded_tokens/filtered": "filtered",
    "response/discarded_tokens/failed": "failed",
    "response/discarded_tokens/invalid": "invalid",
    "response/discarded_tokens/truncated": "truncated",
    "async/discarded_tokens/filtered": "filtered",
    "async/discarded_tokens/expired": "expired",
    "async/discarded_tokens/given_up": "given_up",
    "async/discarded_tokens/aborted": "aborted",
}
PREFIX = GOODPUT_PREFIX  # engine.storage.lake_query.run_goodput sums them over a run
ROLLED_BACK_S = "guard/rolled_back_device_s"  # the step metric of the device-seconds a rollback threw away


def goodput_metrics(metrics: Mapping[str, float], devices: RunDevices, *, shared: bool) -> dict[str, float]:
    """The ``goodput/*`` of one step from its other metrics (``time/*``, ``rollout/produced_tokens``,
    ``response/trained_response_tokens`` and the discarded-token counts)."""
    train, rollout = float(devices.train.devices), float(devices.rollout.devices)
    every = max(train, rollout) if shared else train + rollout
    attest_s = metrics.get("time/attest", 0.0)
    parts = {
        "trained_tokens": metrics.get("time/fit", 0.0) * train,
        "sync": max(0.0, metrics.get("time/sync_weights", 0.0) - attest_s) * every,
        "attest": attest_s * every,
        "discarded/rolled_back": metrics.get(ROLLED_BACK_S, 0.0),
    }
    generation_s = metrics.get("time/rollout", 0.0) * rollout
    produced = metrics.get("rollout/produced_tokens", 0.0)
    left = generation_s
    if produced > 0:
        per_token = generation_s / produced
        trained = min(left, metrics.get("response/trained_response_tokens", 0.0) * per_token)
        parts["trained_tokens"] += trained
        left -= trained
        for key, why in DISCARDED.items():
            spent = min(left, metrics.get(key, 0.0) * per_token)
            parts[f"discarded/{why}"] = parts.get(f"discarded/{why}", 0.0) + spent
            left -= spent
    parts["other_generation"] = left
    used = sum(parts.values())
    parts["idle"] = max(0.0, metrics.get("time/step", 0.0) * every - used)
    whole = used + parts["idle"]
    result = {PREFIX + name: value for name, value in parts.items()}
    result["goodput/percent"] = 100.0 * parts["trained_tokens"] / whole if whole > 0 else 0.0
    return result
