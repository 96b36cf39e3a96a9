"""Goodput: each step's device-seconds split into generating and training the tokens it trained, tokens
generated and thrown away (by why), weight sync, attestation and idle, summing to the step's budget;
in the metrics, the run log's step line, the report and `trellis runs ls`."""

from __future__ import annotations

import pytest

from trellis.engine.run.goodput import goodput_metrics
from trellis.engine.run.local import LocalRun
from trellis.engine.run.metrics import RunDevices, SideDevices
from trellis.engine.run.run_log import run_log_uri
from trellis.engine.storage.lake_query import run_goodput
from trellis.engine.storage.report import write_report
from trellis.engine.storage.store import Store
from helpers import tiny_config

ONE = SideDevices(workers=1, devices_per_worker=1.0)


def step(**values: float) -> dict[str, float]:
    return {"time/step": 10.0, "time/fit": 3.0, "time/rollout": 5.0, "time/sync_weights": 1.0, "time/attest": 0.2,
            "rollout/produced_tokens": 1000.0, "response/trained_response_tokens": 600.0,
            "response/discarded_tokens/filtered": 200.0, "response/discarded_tokens/failed": 100.0, **values}


def test_a_colocated_step_splits_its_device_seconds_into_parts_that_make_the_whole():
    """One shared device, 10 s: generation is 5 s for 1000 tokens (5 ms each)."""
    parts = goodput_metrics(step(), RunDevices(train=ONE, rollout=ONE), shared=True)
    assert parts["goodput/device_s/trained_tokens"] == pytest.approx(3.0 + 600 * 0.005)
    assert parts["goodput/device_s/discarded/filtered"] == pytest.approx(1.0)
    assert parts["goodput/device_s/discarded/failed"] == pytest.approx(0.5)
    assert parts["goodput/device_s/other_generation"] == pytest.approx(0.5)  # 100 tokens neither trained nor discarded
    assert parts["goodput/device_s/sync"] == pytest.approx(0.8) and parts["goodput/device_s/attest"] == pytest.approx(0.2)
    assert parts["goodput/device_s/idle"] == pytest.approx(1.0)
    assert sum(v for k, v in parts.items() if k.startswith("goodput/device_s/")) == pytest.approx(10.0)
    assert parts["goodput/percent"] == pytest.approx(60.0)


def test_a_disaggregated_step_counts_both_sides_devices_and_never_more_generation_than_was_spent():
    """Two rollout devices of their own and one trainer's: 3 devices for 10 s. A batch trained on more
    tokens than this window generated (the asynchronous trainer's earlier windows) takes the whole
    generation time, never more."""
    devices = RunDevices(train=ONE, rollout=SideDevices(workers=2, devices_per_worker=1.0))
    parts = goodput_metrics(step(**{"response/trained_response_tokens": 5000.0}), devices, shared=False)
    assert parts["goodput/device_s/trained_tokens"] == pytest.approx(3.0 + 10.0)
    assert parts["goodput/device_s/discarded/filtered"] == 0.0 and parts["goodput/device_s/other_generation"] == 0.0
    assert parts["goodput/device_s/sync"] == pytest.approx(0.8 * 3)
    assert sum(v for k, v in parts.items() if k.startswith("goodput/device_s/")) == pytest.approx(30.0)
    assert run_goodput({1: parts, 2: parts}) == pytest.approx(parts["goodput/percent"])


def test_a_run_logs_its_goodput_in_metrics_run_log_and_report(tiny_model, reverse_data, tmp_path):
    """Dynamic sampling on the tiny task: flat groups are filtered, and goodput prices their tokens as
    thrown away; each step's parts add up to its time over its one device."""
    config = tiny_config(tiny_model, reverse_data, tmp_path, total_train_steps=2, checkpoint_interval=-1, enable_evaluate=False,
                         dynamic_sampling={"enable": True, "max_rounds": 2})
    with LocalRun(config) as run:
        steps = {index: run.train_step().metrics for index in (1, 2)}
    for metrics in steps.values():
        parts = {k: v for k, v in metrics.items() if k.startswith("goodput/device_s/")}
        assert sum(parts.values()) == pytest.approx(metrics["time/step"], rel=1e-9)
        assert 0 < metrics["goodput/percent"] < 100
        filtered_tokens = metrics["response/discarded_tokens/filtered"]
        assert (parts["goodput/device_s/discarded/filtered"] > 0) == (filtered_tokens > 0)
    assert any(m["response/discarded_tokens/filtered"] > 0 for m in steps.values()), "no group was filtered: nothing was tried"
    log = open(run_log_uri(config.log_uri)).read()
    assert f"goodput {steps[2]['goodput/percent']:.0f}%" in log

    report = write_report(Store(config.run_uri))
    assert "goodput" in report.png_uris
    assert report.headline["goodput_percent"] == pytest.approx(run_goodput(steps))
    assert "Goodput" in open(report.html_uri).read()
