"""Attested weight syncs: after every sync, before any rollout uses the new weights, each engine shows
it holds the trainer's (exact checksums of the bytes each bucket carried, and a canary text's logprobs
on both sides). Tried: one bucket's bytes flipped on the way (caught by the checksums, healed by the
sync's retry), flipped every time (the step fails, names the bucket, and the engine refuses to
generate), and flipped after the checksum, in what the engine loads (only the canary can see it)."""

from __future__ import annotations

import math

import pytest
import torch

from trellis.engine.faults import FAULT_FILE
from trellis.engine.rollout.backends.base import SamplingParams
from trellis.engine.run.local import LocalRun
from trellis.engine.run.run_log import run_log_uri
from trellis.engine.weights.attestation import (
    CORRUPT_APPLIED,
    CORRUPT_RECEIVED,
    UnattestedWeightsError,
    WeightAttestationError,
    attests,
    bucket_checksums,
    canary_difference,
    checksum_differences,
)
from helpers import tiny_config


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(64, 32, generator=generator) for name in ("a.weight", "b.weight", "c.weight")}


def test_checksums_agree_on_the_same_bytes_and_name_the_bucket_whose_bytes_differ():
    sent = bucket_checksums(weights(), bucket_bytes=2 * 64 * 32 * 4)  # two tensors a bucket: [a, b], [c]
    assert len(sent) == 2 and sent == bucket_checksums({k: v.clone() for k, v in weights().items()}, bucket_bytes=2 * 64 * 32 * 4)
    assert sent != bucket_checksums(weights())  # another cut into buckets is another record

    flipped = weights()
    flipped["c.weight"].view(-1).view(torch.uint8)[100] ^= 1  # one bit
    assert checksum_differences(sent, bucket_checksums(flipped, bucket_bytes=2 * 64 * 32 * 4)) == [
        "bucket 1 (c.weight .. c.weight, 1 tensors, 8192 bytes)"
    ]
    swapped = weights()
    swapped["a.weight"], swapped["b.weight"] = swapped["b.weight"], swapped["a.weight"]  # same bytes, moved
    assert checksum_differences(sent, bucket_checksums(swapped, bucket_bytes=2 * 64 * 32 * 4))[0].startswith("bucket 0")


def test_a_tensor_read_from_inside_a_bucket_sums_as_the_same_tensor_on_its_own():
    """bf16 views into one flat buffer at offsets of 2 bytes (CUDA IPC and broadcast hand such views
    over) against standalone copies (the object store's)."""
    flat = torch.randn(3 + 8 * 8 + 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    views = {"odd": flat[:3], "square": flat[3:67].view(8, 8), "rest": flat[67:]}
    assert views["square"].storage_offset() * 2 % 4 == 2
    assert bucket_checksums(views) == bucket_checksums({name: view.clone() for name, view in views.items()})


def test_a_canary_that_is_not_finite_or_of_another_length_is_infinitely_far():
    assert canary_difference([-1.0, -2.0], [-1.5, -2.0]).mean == 0.25
    assert math.isinf(canary_difference([-1.0, -2.0], [float("nan"), -2.0]).mean)
    assert math.isinf(canary_difference([-1.0, -2.0], [-1.0]).max)


def _config(tiny_model, reverse_data, tmp_path, **changes):
    return tiny_config(tiny_model, reverse_data, tmp_path, **{"total_train_steps": 1, "checkpoint_interval": -1,
                                                               "enable_evaluate": False, "attest": {"enabled": True}, **changes})


def test_every_sync_is_attested_and_its_figures_are_the_steps_metrics(tiny_model, reverse_data, tmp_path):
    with LocalRun(_config(tiny_model, reverse_data, tmp_path), track=False) as run:
        metrics = run.train_step().metrics
        intake = run.workers.backend.intake
        assert intake.policy_version == 1 and not intake.held and len(intake.received) >= 1
    assert metrics["attest/passed"] == 1.0 and metrics["attest/retries"] == 0.0
    assert metrics["attest/canary_diff_max"] < 1e-4  # float32 on both sides: only the order of additions differs
    assert metrics["time/attest"] > 0.0


def test_a_garbled_bucket_is_caught_and_the_sync_tried_again(tiny_model, reverse_data, tmp_path, monkeypatch):
    marker = tmp_path / "fault"
    marker.write_text(f"{CORRUPT_RECEIVED} 0 1")  # the first sync's bytes are flipped on arrival, once
    monkeypatch.setenv(FAULT_FILE, str(marker))
    config = _config(tiny_model, reverse_data, tmp_path / "run", total_train_steps=2)
    with LocalRun(config, track=False) as run:
        first, second = run.train_step().metrics, run.train_step().metrics
    assert (tmp_path / "fault.fired").read_text().startswith(CORRUPT_RECEIVED)
    assert first["attest/retries"] == 1.0 and second["attest/retries"] == 0.0
    log = open(run_log_uri(config.log_uri)).read()
    assert "The weight sync of step 1 was not attested (attempt 1): rollout engine 0: bytes differ from those sent in bucket 0" in log
    assert "syncing again" in log


def test_a_sync_garbled_every_time_fails_the_step_and_no_rollout_uses_it(tiny_model, reverse_data, tmp_path, monkeypatch):
    marker = tmp_path / "fault"
    marker.write_text(f"{CORRUPT_RECEIVED} 0 2")  # the sync and its retry
    monkeypatch.setenv(FAULT_FILE, str(marker))
    with LocalRun(_config(tiny_model, reverse_data, tmp_path / "run", total_train_steps=2), track=False) as run:
        with pytest.raises(WeightAttestationError, match="step 1 failed its attestation 2 times: rollout engine 0: bytes differ") as error:
            run.train_step()
        assert "| 0 | bytes differ from those sent in bucket 0" in error.value.page
        with pytest.raises(UnattestedWeightsError, match="weights of step 1, which are not attested"):
            run.workers.backend.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0.0))


def test_weights_garbled_after_their_checksum_are_caught_by_the_canary(tiny_model, reverse_data, tmp_path, monkeypatch):
    """The bytes arrived whole, but the engine loads others (as one whose load silently went wrong):
    only the canary, scored on both sides, can tell."""
    marker = tmp_path / "fault"
    marker.write_text(f"{CORRUPT_APPLIED} 0 2")
    monkeypatch.setenv(FAULT_FILE, str(marker))
    with LocalRun(_config(tiny_model, reverse_data, tmp_path / "run"), track=False) as run:
        with pytest.raises(WeightAttestationError) as error:
            run.train_step()
    assert "canary logprobs differ by" in str(error.value) and "bytes differ" not in str(error.value)


def test_attestation_is_off_by_default_on_cpu_and_on_with_an_accelerator(tiny_model, reverse_data, tmp_path):
    config = _config(tiny_model, reverse_data, tmp_path, attest={})
    assert not attests(config)
    assert attests(config.model_copy(update={"rollout": config.rollout.model_copy(update={"backend": "vllm"})}))
    with LocalRun(config, track=False) as run:
        metrics = run.train_step().metrics
        assert run.workers.backend.intake.received == () and not run.workers.backend.intake.held
    assert not any(name.startswith("attest/") for name in metrics)

