"""Two nodes of one private cluster on this machine: trellis's flow runs with its trainer ranks spread
over both nodes (one gloo group across them), and asks for more than the cluster has are refused
before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ray = pytest.importorskip("ray")

from trellis.engine.cluster.placement import GpuPlacementError
from trellis.engine.cluster.workers import RunWorkers
from trellis.engine.storage.checkpoints import require_complete
from trellis.engine.storage.store import Store
from trellis.engine.train.worker import TrainingWorker
from trellis.flows.rl_train import rl_train
from helpers import logged_metrics, tiny_config
from two_nodes import alive_nodes, second_node


def test_the_flow_runs_with_trainer_ranks_on_both_nodes(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """Disaggregated, 2 trainer ranks and 2 rollout workers, each side placed STRICT_SPREAD: one rank
    and one rollout worker on each node; the run's three steps train, sync weights to both workers
    and checkpoint across the nodes: the step-3 checkpoint is complete (marker, train state), each
    rank wrote its own shards and state, and it loads into a fresh one-process trainer as exactly
    the weights the ranks hold after step 3 (and both rollout workers serve). Tried: the seal's
    COMPLETE marker left out (``require_complete`` refuses it), and the checkpoint saved before the
    step's fit (it loads as step 2): both fail it."""
    head_id = ray.get_runtime_context().get_node_id()
    with second_node(ray_cluster, tmp_path, num_cpus=2) as node2:
        assert {n["NodeManagerAddress"] for n in alive_nodes()} == {"127.0.0.1"}  # loopback only
        config = tiny_config(
            tiny_model, reverse_data, tmp_path, experiment_name="two-nodes", trainer="disaggregated", total_train_steps=3,
            checkpoint_interval=3, enable_evaluate=False, enable_initial_evaluate=False,
            train_resources={"num_workers": 2}, rollout_resources={"num_workers": 2}, replay_buffer={"max_staleness": 1},
            cluster={"address": ray_cluster["address"], "placement_strategy": "STRICT_SPREAD", "release_workers_at_end": False},
        )
        workers = RunWorkers(config)
        try:
            rl_train(config)
            ranks, rollouts = workers.actors("trainer"), workers.actors("rollout")
            assert set(ray.get([rank.node_id.remote() for rank in ranks], timeout=60)) == {head_id, node2}
            assert set(ray.get([rollout.node_id.remote() for rollout in rollouts], timeout=60)) == {head_id, node2}
            assert ray.get(ranks[0].applied_step.remote(), timeout=60) == 3
            assert ray.get([rollout.policy_version.remote() for rollout in rollouts], timeout=60) == [3, 3]
            trained = ray.get([rank.export_weights.remote() for rank in ranks], timeout=120)[0]  # collective: rank 0 has them
            served = ray.get([rollout.served_weights.remote() for rollout in rollouts], timeout=120)
        finally:
            workers.release()  # before the node goes: its placement group would be rescheduled
    metrics = logged_metrics(config)
    assert sorted(metrics) == [1, 2, 3] and all(m["train/grad_norm"] > 0 for m in metrics.values())

    checkpoint = f"{config.run_uri}/checkpoints/step-000003"
    assert require_complete(Store(checkpoint))["step"] == 3
    for part in ("model", "optim"):  # one shard file per rank, one rank per node
        assert sorted(p.name for p in Path(checkpoint, part).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(Path(checkpoint, name).is_file() for name in ("trainer.pt", "trainer-rank1.pt", "controller.pt"))
    pad_id = AutoTokenizer.from_pretrained(tiny_model).pad_token_id
    loader = TrainingWorker(tiny_config(tiny_model, reverse_data, tmp_path / "loader"), total_train_steps=3, pad_token_id=pad_id)
    assert loader.load_checkpoint(Store(checkpoint)) == 3
    loaded = loader.export_weights()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert loaded.keys() == trained.keys()
    assert [name for name in trained if not torch.equal(loaded[name], trained[name])] == []
    assert not torch.equal(loaded["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    for weights in served:
        assert [name for name in trained if not torch.equal(weights[name], trained[name])] == []


def test_more_workers_than_the_cluster_has_are_refused_before_any_starts(tiny_model, reverse_data, tmp_path, ray_cluster):
    """Tried: 2 trainer ranks of 2 CPUs each and a rollout worker on a 2-CPU cluster. The error names
    what was asked and what the cluster has, at once (no placement group left pending), and no worker
    of the run is alive afterwards."""
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="too-big", trainer="disaggregated",
        train_resources={"num_workers": 2, "accelerators_per_worker": 2}, cluster={"address": ray_cluster["address"]},
    )
    with pytest.raises(GpuPlacementError, match=r"asks for 5 CPU \(train: 2 x 2 CPU, rollout: 1 x 1 CPU\), but the Ray cluster has 2"):
        RunWorkers(config).attach()
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == config.ray_namespace]
    assert named == []
    assert all(g.get("name", "").find("too-big") < 0 or g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


def test_a_run_waiting_for_devices_another_run_holds_names_that_run(tiny_model, reverse_data, tmp_path, ray_cluster, caplog):
    """Tried: a placement group of another run ("trellis-kept-train", as a run with its workers kept
    leaves it) holding both of the cluster's CPUs, then a disaggregated run on the same cluster. The
    wait says which group holds the cluster, and the error after ray_get_timeout_s names it too; the
    waiting run leaves no group behind."""
    from ray.util.placement_group import placement_group, remove_placement_group

    squatter = placement_group([{"CPU": 2.0}], name="trellis-kept-train", lifetime="detached")
    assert squatter.wait(timeout_seconds=60)
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="waits", trainer="disaggregated",
        cluster={"address": ray_cluster["address"], "ray_get_timeout_s": 12},
    )
    try:
        with pytest.raises(GpuPlacementError, match=r"could not place within 12s; its other placement groups hold: trellis-kept-train \[\{'CPU': 2\.0\}\]"):
            RunWorkers(config).attach()
    finally:
        remove_placement_group(squatter)
    assert any("trellis-kept-train" in record.getMessage() for record in caplog.records if record.levelname == "WARNING")
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values() if g["name"].startswith("trellis-waits-"))
