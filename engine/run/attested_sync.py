"""A weight sync and its attestation (``engine.weights.attestation``), written once for both ``Workers``
implementations: push, gather the evidence of each side, compare, admit or sync again."""

from __future__ import annotations

import time
from typing import Any, Callable

from trellis.engine.config import TrellisConfig
from trellis.engine.run.run_log import run_log_for
from trellis.engine.weights.attestation import (
    WeightAttestationError,
    admit,
    attest,
    attests,
    canary_tolerance,
    canary_tokens,
    engine_evidence,
    trainer_evidence,
)

_CANARIES: dict[tuple[str, str], list[int]] = {}  # (tokenizer, text) -> token ids, asked once per process

# Runs (role, fn, args) calls, each on every worker of its role, at once where they can; per call, the
# workers' results in order.
RunCalls = Callable[..., list[list[Any]]]


def attested_sync(config: TrellisConfig, policy_version: int, push: Callable[[], Any], run_calls: RunCalls,
                  hand_accelerator_to: Callable[[str], None], *, shares_accelerator: bool) -> dict[str, float]:
    """``push`` the trainer's weights to the engines and, with ``attest.enabled``, attest them: the
    trainer and then the engines score the canary (each side holding the accelerator in turn, where
    they share one), and the evidence is compared. A failure pushes again, up to
    ``attest.sync_retries`` times, then raises ``WeightAttestationError``; a pass admits the engines.
    Returns the ``attest/*`` metrics."""
    settings = config.attest
    if not attests(config):
        push()
        return {}
    tolerance = canary_tolerance(config)
    key = (config.tokenizer_source, settings.canary_text)
    if key not in _CANARIES:
        _CANARIES[key] = run_calls(("controller", canary_tokens, (settings.canary_text,)))[0][0]
    tokens = _CANARIES[key]
    for attempt in range(1, settings.sync_retries + 2):
        push()
        started = time.perf_counter()
        # One side after the other, also where they could overlap: two forwards at once on the same
        # cores took 0.7 s instead of 10 ms on 2 CPU cores (their thread pools spin against each other).
        if shares_accelerator:
            hand_accelerator_to("trainer")
        (trainers,) = run_calls(("trainer", trainer_evidence, (tokens,)))
        if shares_accelerator:
            hand_accelerator_to("rollout")
        (engines,) = run_calls(("rollout", engine_evidence, (tokens,)))
        verdict = attest(trainers[0], engines, policy_version, tolerance)  # rank 0 sent the weights
        verdict.seconds = time.perf_counter() - started
        if verdict.passed:
            run_calls(("rollout", admit, ()))
            return {
                "attest/passed": 1.0,
                "attest/retries": float(attempt - 1),
                "attest/canary_diff_mean": max(d.mean for d in verdict.differences),
                "attest/canary_diff_max": max(d.max for d in verdict.differences),
                "time/attest": verdict.seconds,
            }
        failed = "; ".join(f"rollout engine {e}: {', '.join(r)}" for e, r in sorted(verdict.failures.items()))
        again = "; syncing again" if attempt <= settings.sync_retries else ""
        run_log_for(config).warning(f"The weight sync of step {policy_version} was not attested (attempt {attempt}): {failed}{again}")
    raise WeightAttestationError(verdict, settings.sync_retries + 1)
