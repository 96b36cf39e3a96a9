"""The stability guard: rules over each step's metrics after its update; a tripped rule rolls the run
back to its last good checkpoint, sets the discarded steps aside, lowers the learning rate and goes on.

Tried: an injected learning-rate spike (``trainer.lr_spike``: one optimizer step at 100x its lr, which
collapses the tiny task's reward to 0) in process and through the Prefect flow on Ray, with the prompts
drawn again and with them skipped; ``on_trip: stop``; a run already at ``max_rollbacks``; a run with no
checkpoint confirmed good; and the rules alone on hand-made histories."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from trellis.engine.config import GuardConfig
from trellis.engine.faults import FAULT_FILE, LR_SPIKE
from trellis.engine.run.guard import StabilityGuard
from trellis.engine.run.local import LocalRun
from trellis.engine.run.rollback import StabilityGuardTripped
from trellis.engine.storage.checkpoints import SaveStore
from trellis.engine.storage.rollbacks import read_trips
from trellis.engine.storage.store import Store
from helpers import ledger_check, tiny_config


def passed(guard: StabilityGuard, *steps: dict[str, float]) -> StabilityGuard:
    for step, metrics in enumerate(steps, 1):
        assert guard.check(step, metrics) is None
    return guard


def test_each_rule_against_a_hand_computed_history():
    history = [{"train/grad_norm": g, "entropy/rollout": e, "response/rewards/mean": r}
               for g, e, r in [(1.0, 0.4, 0.2), (2.0, 0.5, 0.3), (3.0, 0.6, 0.25)]]  # medians: 2.0, 0.5, 0.25
    guard = passed(StabilityGuard(GuardConfig(enabled=True)), *history)
    healthy = {"train/grad_norm": 19.0, "entropy/rollout": 0.06, "response/rewards/mean": 0.07, "mismatch/k3_kl": 0.9}
    assert guard.check(4, healthy) is None  # every value just inside its bound (20, 0.05, 0.0625, 1.0)
    guard = passed(StabilityGuard(GuardConfig(enabled=True)), *history)
    trip = guard.check(4, {"train/grad_norm": 21.0, "entropy/rollout": 0.04, "response/rewards/mean": 0.06, "mismatch/k3_kl": 1.1})
    assert [(b.rule, b.bound, b.median) for b in trip.breaches] == [
        ("k3_mismatch", 1.0, None), ("grad_norm_spike", 20.0, 2.0), ("entropy_collapse", 0.05, 0.5), ("reward_collapse", 0.0625, 0.25)]
    assert "grad_norm_spike: train/grad_norm = 21, bound 20 (running median 2)" in trip.summary()
    assert list(guard.history["train/grad_norm"]) == [1.0, 2.0, 3.0]  # a tripped step does not join the history

    nan = StabilityGuard(GuardConfig(enabled=True)).check(1, {"train/pg_loss": math.nan, "train/grad_norm": 1.0})
    assert [(b.rule, b.metric) for b in nan.breaches] == [("nonfinite", "train/pg_loss")]  # judged from the first step
    young = passed(StabilityGuard(GuardConfig(enabled=True)), *history[:2])
    assert young.check(3, {"train/grad_norm": 100.0, "response/rewards/mean": 0.0}) is None  # min_history: 3
    absolute = passed(StabilityGuard(GuardConfig(enabled=True, reward_collapse=None, reward_drop=0.1)), *history)
    assert [b.rule for b in absolute.check(4, {"response/rewards/mean": 0.14}).breaches] == ["reward_drop"]  # < 0.25 - 0.1


def guarded(tiny_model, reverse_data, tmp_path, **guard):
    return tiny_config(tiny_model, reverse_data, tmp_path, total_train_steps=10, checkpoint_interval=2, evaluate_step=10,
                       enable_initial_evaluate=True, guard={"enabled": True, **guard})


def spike_at(tmp_path: Path, optimizer_step: int, monkeypatch) -> Path:
    marker = tmp_path / "fault"
    marker.write_text(f"{LR_SPIKE} {optimizer_step - 1}")
    monkeypatch.setenv(FAULT_FILE, str(marker))
    return marker


def metrics_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_lr_spike_trips_the_guard_which_rolls_back_and_the_run_still_learns(tiny_model, reverse_data, tmp_path, monkeypatch):
    marker = spike_at(tmp_path, 6, monkeypatch)  # step 6's update; its damage shows in step 7's rollouts
    config = guarded(tiny_model, reverse_data, tmp_path / "work")
    with LocalRun(config) as run:
        reports = run.run()
    assert Path(f"{marker}.fired").exists()
    run_dir = Path(config.run_uri)
    (trip,) = read_trips(Store(config.run_uri))
    # Checkpoints 2, 4, 6 were complete; 6 is not confirmed (step 7 judged its policy), so back to 4.
    assert (trip["action"], trip["step"], trip["rules"], trip["to_step"], trip["discarded"]) == ("rollback", 7, ["reward_collapse"], 4, [5, 6, 7])
    assert trip["breaches"][0]["value"] == 0.0 and trip["lr_scale"] == 0.5
    assert [r.step for r in reports] == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10]

    archive = run_dir / "rollbacks" / "rollback=01"
    assert sorted(p.parent.name for p in archive.glob("trajectories/split=train/*/part-0.parquet")) == [
        "step=000005", "step=000006", "step=000007"]
    assert pq.read_table(archive / "trajectories/split=train/step=000007/part-0.parquet")["reward"].to_pylist() == [0.0] * 128
    set_aside = metrics_lines(archive / "metrics.jsonl")
    assert [m["step"] for m in set_aside] == [5, 6]  # step 7 tripped before it was logged
    logged = metrics_lines(run_dir / "logs" / "metrics.jsonl")
    assert [m["step"] for m in logged] == list(range(0, 11))  # each step once: the run as it stands
    assert logged[5]["train/lr"] == pytest.approx(0.5 * set_aside[0]["train/lr"])
    # The prompts are drawn again in the same order: step 5 again samples what it sampled before the spike.
    assert logged[5]["response/rewards/mean"] == set_aside[0]["response/rewards/mean"]
    assert SaveStore(Store(f"{config.run_uri}/checkpoints")).complete_steps() == [2, 4, 6, 8, 10]
    # Goodput: every device-second of steps 5 and 6 as logged, and of the tripped step 7, counted as thrown
    # away in the first step logged after the rollback.
    spent = sum(v for m in set_aside for k, v in m.items() if k.startswith("goodput/device_s/"))
    assert logged[5]["goodput/device_s/discarded/rolled_back"] == logged[5]["guard/rolled_back_device_s"] > spent > 0
    assert "guard/rolled_back_device_s" not in logged[6]
    assert logged[10]["eval/accuracy"] > logged[0]["eval/accuracy"] + 0.05  # it still learns the task
    log = (run_dir / "logs" / "run.log").read_text()
    assert "Step 7: the stability guard tripped (reward_collapse: response/rewards/mean = 0" in log
    assert "Rolled back to the checkpoint of step 4 (rollback 1 of at most 3); steps 5-7 set aside" in log
    assert "drawn again; learning rate now 0.5 x the configured one" in log
    assert "rolled_back" in ledger_check(config)


def test_skipped_batches_are_never_trained_on_again_and_the_ledger_ends_them(tiny_model, reverse_data, tmp_path, monkeypatch):
    spike_at(tmp_path, 6, monkeypatch)
    config = guarded(tiny_model, reverse_data, tmp_path / "work", skip_batches=True)
    with LocalRun(config) as run:
        run.run()
    archive = Path(config.run_uri) / "rollbacks" / "rollback=01"
    set_aside = {row["prompt_index"] for path in archive.glob("trajectories/split=train/*/part-0.parquet")
                 for row in pq.read_table(path, columns=["prompt_index"]).to_pylist()}
    trained = {row["prompt_index"] for path in Path(config.run_uri).glob("trajectories/split=train/*/part-0.parquet")
               for row in pq.read_table(path, columns=["prompt_index"]).to_pylist()}
    assert len(set_aside) == 3 * 16 and not set_aside & trained
    rolled_back = [row for path in Path(config.run_uri).glob("ledger/groups/*/part-1.parquet") for row in pq.read_table(path).to_pylist()]
    assert {row["prompt_index"] for row in rolled_back} == set_aside and {row["status"] for row in rolled_back} == {"rolled_back"}
    ledger_check(config)


def test_the_guard_stops_the_run_when_it_may_not_roll_back(tiny_model, reverse_data, tmp_path, monkeypatch):
    spike_at(tmp_path, 6, monkeypatch)
    config = guarded(tiny_model, reverse_data, tmp_path / "stop", on_trip="stop")
    with LocalRun(config) as run, pytest.raises(StabilityGuardTripped, match="stopped the run at step 7: reward_collapse") as error:
        run.run()
    assert "It did not roll back: guard.on_trip is stop" in str(error.value)
    # The bound is the rule's fraction of the running median; the rewards themselves vary with the CPU's
    # float kernels (an AMD EPYC gave a median of 0.2852 where an earlier machine's bound read 0.06).
    row = re.search(r"\| reward_collapse \| `response/rewards/mean` \| 0 \| ([\d.]+) \| ([\d.]+) \|", error.value.page)
    assert row and float(row[1]) == pytest.approx(config.guard.reward_collapse * float(row[2]), rel=1e-3)
    assert [t["action"] for t in read_trips(Store(config.run_uri))] == ["stop"]
    assert SaveStore(Store(f"{config.run_uri}/checkpoints")).complete_steps() == [2, 4, 6]  # kept for a resume

    # A run that already used its rollbacks (its record says so) stops too.
    spike_at(tmp_path, 6, monkeypatch)
    spent = guarded(tiny_model, reverse_data, tmp_path / "spent", max_rollbacks=1)
    (Path(spent.run_uri) / "rollbacks").mkdir(parents=True)
    (Path(spent.run_uri) / "rollbacks" / "trips.jsonl").write_text(json.dumps({"action": "rollback", "step": 3}) + "\n")
    with LocalRun(spent) as run, pytest.raises(StabilityGuardTripped, match="already rolled back 1 times"):
        run.run()


def test_a_rollback_needs_checkpoints_and_bad_guard_settings_are_named(tiny_model, reverse_data, tmp_path):
    from trellis.engine.config.loading import ConfigError

    for guard, says in [({"max_rollbacks": 0}, "guard.max_rollbacks: Input should be greater than or equal to 1"),
                        ({"lr_factr": 0.5}, "guard.lr_factr: unknown key; did you mean 'lr_factor'?"),
                        ({"entropy_collapse": 2.0}, "guard.entropy_collapse: Input should be less than 1"),
                        ({"enabled": True, "window": 2, "min_history": 3}, "guard.min_history (3) cannot exceed guard.window (2)")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            tiny_config(tiny_model, reverse_data, tmp_path, guard=guard)
    with pytest.raises(ValueError, match="guard.on_trip: rollback needs checkpoints to roll back to"):
        tiny_config(tiny_model, reverse_data, tmp_path, checkpoint_interval=-1, guard={"enabled": True})
    with pytest.raises(ValueError, match="guard.skip_batches is for colocated runs"):
        tiny_config(tiny_model, reverse_data, tmp_path, trainer="disaggregated", guard={"enabled": True, "skip_batches": True})


def test_the_flow_rolls_back_as_a_branch_of_the_step_dag(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """Prefect flow runs on Ray actors: the tripped step's flow run ends in check_stability and roll_back
    (the branch an operator sees in the UI), the trip is an artifact, and the lineage shows the branch."""
    import asyncio

    from prefect.client.orchestration import get_client

    from trellis.flows.rl_train import rl_train
    from test_flow import step_task_runs

    marker = tmp_path / "fault"
    marker.write_text(f"{LR_SPIKE} 5")  # the trainer actor's 6th optimizer step
    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="guarded_flow", total_train_steps=8, checkpoint_interval=2,
                         enable_evaluate=False, guard={"enabled": True},
                         cluster={**ray_cluster["cluster"], "runtime_env": {"env_vars": {FAULT_FILE: str(marker)}}})
    rl_train(config)
    names = [run.name for run in asyncio.run(step_task_runs("rl_run[guarded_flow]"))]
    assert {"check_stability[step=7]", "roll_back[step=7]"} <= set(names)
    assert names.count("fit[step=5]") == 2 and "sync_weights[step=7]" in names  # step 7 ran again after steps 5 and 6
    assert sum(name.startswith("roll_back") for name in names) == 1
    from test_flow import read_logs
    (roll_back,) = [run.id for run in asyncio.run(step_task_runs("rl_run[guarded_flow]")) if run.name == "roll_back[step=7]"]
    assert any("Step 7: the stability guard tripped" in log.message for log in asyncio.run(read_logs([roll_back])))  # in the UI too

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts()

    (page,) = [a for a in asyncio.run(artifacts()) if a.key == "guarded-flow-stability-guard"]
    assert "Rolled back** to the checkpoint of step 4" in page.data and "reward_collapse" in page.data
    assert [m["step"] for m in metrics_lines(Path(config.run_uri) / "logs" / "metrics.jsonl")] == list(range(0, 9))  # 0: the initial evaluation
    ledger_check(config)
    shown = subprocess.run([str(Path(sys.executable).with_name("trellis")), "lineage", f"{config.run_uri}@6"], capture_output=True, text=True)
    assert "rolled back   steps 5-7 after step 4: reward_collapse tripped at step 7 (rollback 1; set aside)" in shown.stdout, shown.stderr


def test_a_disaggregated_run_rolls_back_its_producer_too(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """The asynchronous trainer: the producer is paused, its replay buffer and prompt order go back with
    the checkpoint, and it goes on with the checkpoint's weights; the ledger still holds every prompt
    once. A checkpoint is confirmed max_staleness steps later than a colocated run's."""
    from trellis.flows.rl_train import rl_train
    from helpers import logged_metrics

    marker = tmp_path / "fault"
    marker.write_text(f"{LR_SPIKE} 5")
    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="guarded_async", trainer="disaggregated",
                         replay_buffer={"max_staleness": 1}, total_train_steps=12, checkpoint_interval=2, enable_evaluate=False,
                         enable_initial_evaluate=False, guard={"enabled": True},
                         cluster={**ray_cluster["cluster"], "runtime_env": {"env_vars": {FAULT_FILE: str(marker)}}})
    rl_train(config)
    (trip,) = read_trips(Store(config.run_uri))
    assert trip["action"] == "rollback" and trip["to_step"] + 2 < trip["step"] and trip["to_step"] < 6, trip
    metrics = logged_metrics(config)
    assert sorted(metrics) == list(range(1, 13))
    assert all(metrics[step]["async/staleness_max"] <= 1 for step in metrics)
    after = [m["response/rewards/mean"] for step, m in metrics.items() if step > trip["to_step"]]
    assert min(after[-4:]) > 0.1  # recovered: the spiked weights' zero rewards are gone
    ledger_check(config)
