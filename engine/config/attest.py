"""The ``attest:`` section: attested weight syncs (``engine.weights.attestation``)."""

from __future__ import annotations

from pydantic import Field

from trellis.engine.config.base import Frozen


class AttestConfig(Frozen):
    """Attested weight syncs (``engine.weights.attestation``): after every sync, before any rollout uses
    the new weights, every rollout engine shows it holds the trainer's: exact checksums of the bytes each
    bucket carried, taken on both sides, and a canary text's logprobs from the trainer and from each
    engine. A failed attestation syncs again, then fails the step; an engine generates only with
    attested weights."""

    enabled: bool | None = Field(
        None, description="Attest every weight sync: a checksum pass over the weights and one short forward per side. Unset "
        "(default): on where the rollout runs on an accelerator (on one H200 with vLLM the step took 0.96x as long with it as "
        "without), off on CPU (where it cost the tiny task's flow step 14%).",
    )
    canary_text: str = Field(
        "The canary sings at dawn: seven quiet bells, three open doors, and a letter that arrives one day late.",
        min_length=8, description="The text whose first 32 tokens both sides score, teacher-forced, at temperature 1.",
    )
    canary_tolerance: float | None = Field(
        None, gt=0.0,
        description="Largest mean |logprob difference| over the canary's tokens an engine may show. Default: 1e-3 for "
        "a float32 engine (CPU), 0.1 for a 16-bit one, 0.3 for FP8 rollout (rollout.quantization).",
    )
    sync_retries: int = Field(1, ge=0, description="Syncs tried again after a failed attestation before the step fails.")
