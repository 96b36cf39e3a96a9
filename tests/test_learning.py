"""GRPO provably learns the bundled task on CPU, in-process, seeded and deterministic."""

import json

import pyarrow.dataset as ds

from trellis.engine.config.loading import load_config
from trellis.engine.run.local import LocalRun
from helpers import WALL_CLOCK


def test_fifty_grpo_steps_lift_held_out_greedy_accuracy(tiny_model, reverse_data, tmp_path):
    config = load_config(
        "configs/tiny_reverse.yaml",
        load_from=str(tiny_model),
        train_dataset={"path": str(reverse_data["train"]), "max_prompt_length": 64},
        eval_dataset={"path": str(reverse_data["eval"]), "max_prompt_length": 64},
        work_dir=str(tmp_path),
    )
    with LocalRun(config) as run:
        reports = run.run()

    initial, final = reports[0].metrics["eval/accuracy"], reports[-1].metrics["eval/accuracy"]
    rewards = [r.metrics["response/rewards/mean"] for r in reports[1:]]
    assert 0.3 <= initial <= 0.5, f"the warmed-up model should start near 0.39, got {initial}"
    assert final >= 0.75, f"held-out greedy accuracy {initial:.3f} -> {final:.3f}"
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1
    assert [r.metrics["rollout/policy_version"] for r in reports[1:4]] == [0, 1, 2]  # synced every step

    lines = (tmp_path / "tiny_reverse" / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(0, 51))
    last = json.loads(lines[-1])
    lake = ds.dataset(tmp_path / "tiny_reverse" / "trajectories" / "split=train", partitioning="hive").to_table()
    assert lake.num_rows == 50 * 16 * 8 and sorted(set(lake.column("step").to_pylist())) == list(range(1, 51))
    for key in ("time/produce_batch", "time/prepare_data", "time/fit", "time/sync_weights", "time/step",
                "throughput/effective_tgs", "throughput/rollout_tgs", "entropy/train", "mismatch/k3_kl"):
        assert key in last
    assert 0 < last["time/rollout"] <= last["time/step"]  # the batch's own generation and scoring


def test_two_seeded_deterministic_runs_are_identical(tiny_model, reverse_data, tmp_path):
    def run_three_steps(folder):
        config = load_config(
            "configs/tiny_reverse.yaml",
            ["total_train_steps=3", "enable_evaluate=false", "enable_initial_evaluate=false"],
            load_from=str(tiny_model),
            train_dataset={"path": str(reverse_data["train"])},
            eval_dataset=None,
            work_dir=str(folder),
        )
        with LocalRun(config, track=False) as run:
            return [{k: v for k, v in r.metrics.items() if not k.startswith(WALL_CLOCK)} for r in run.run()]

    assert run_three_steps(tmp_path / "a") == run_three_steps(tmp_path / "b")
