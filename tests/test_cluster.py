"""Workers on a live cluster are re-used only when they were built from this run's code and settings,
and a cluster that runs another trellis is refused before any worker exists."""

from __future__ import annotations

import pytest

from trellis.engine.cluster import environment
from trellis.engine.cluster.environment import ClusterEnvironmentError
from trellis.engine.cluster.workers import RunWorkers
from helpers import tiny_config


def test_live_workers_built_for_another_storage_are_replaced_and_a_longer_run_keeps_them(
    tiny_model, reverse_data, tmp_path, ray_cluster, caplog
):
    """Tried as in the bug report: workers left alive by a run writing to one work_dir, then a run of
    the same experiment writing elsewhere. Its workers are new processes (they would have written to
    the first run's storage). Extending only total_train_steps, a driver-only setting, keeps them."""
    cluster = {"address": ray_cluster["address"]}
    first = tiny_config(tiny_model, reverse_data, tmp_path / "a", experiment_name="stale", cluster=cluster)
    moved = tiny_config(tiny_model, reverse_data, tmp_path / "b", experiment_name="stale", cluster=cluster)
    longer = moved.model_copy(update={"total_train_steps": 8})
    try:
        RunWorkers(first).attach()
        before = RunWorkers(first).pids()
        RunWorkers(moved).attach()
        replaced = RunWorkers(moved).pids()
        RunWorkers(longer).attach()
        kept = RunWorkers(longer).pids()
    finally:
        RunWorkers(first).release()
    assert set(before.values()).isdisjoint(replaced.values())
    assert kept == replaced
    assert any("differ from this run in the config (work_dir)" in record.getMessage() for record in caplog.records)


def test_a_cluster_running_another_trellis_is_refused_before_any_worker_exists(
    tiny_model, reverse_data, tmp_path, ray_cluster, monkeypatch
):
    """The driver's trellis is made to differ from the one the cluster's workers import (as a run from
    another checkout or virtualenv would): attaching stops with what to do, and no actor was created."""
    monkeypatch.setattr(environment, "trellis_code", lambda: "0.0.0+another-checkout")
    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="other_trellis",
                         cluster={"address": ray_cluster["address"]})
    workers = RunWorkers(config)
    with pytest.raises(ClusterEnvironmentError, match=r"runs trellis .*; this run is trellis 0.0.0\+another-checkout"):
        workers.attach()
    with pytest.raises(ValueError):
        workers.actor("controller")
