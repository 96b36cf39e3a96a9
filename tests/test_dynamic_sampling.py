"""DAPO's dynamic sampling and overlong shaping, and the OPO estimator, against hand-computed examples;
then one real step on the tiny model to see their counters reach the metrics."""

import json

import fsspec
import pytest
import torch

from trellis.engine.algo.advantages import opo
from trellis.engine.algo.reward_shaping import overlong_penalty
from trellis.engine.rollout.rewards.shaping import OverlongShaping
from trellis.engine.config import AdvantageConfig
from trellis.engine.data.prepare import prepare_train_data
from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.rollout.production.dynamic_sampling import fill_batch
from trellis.engine.rollout.production.produce import ProduceResult
from trellis.engine.run.local import LocalRun
from helpers import lake_rows, tiny_config


def sample(rollout_id, reward, *, group="g", response=(4, 5, 6), finish="stop", cap=None):
    return RolloutSample(
        rollout_id=rollout_id, group_id=group, session_id=rollout_id, prompt_index=0,
        messages=[{"role": "user", "content": "x"}], prompt_ids=[1, 2, 3], label="y", data_source="d",
        task_name="t", response_ids=list(response), logprobs=[-0.5] * len(response), response="abc",
        finish_reason=finish, reward=reward, max_new_tokens=cap,
    )


def test_overlong_penalty_is_zero_before_the_buffer_then_linear_to_the_factor():
    # budget 20, buffer 8: free up to 12 tokens, then -0.5 per 8 tokens of excess x factor 0.5.
    assert [overlong_penalty(n, 20, 8, 0.5) for n in (5, 12, 13, 16, 20)] == [0.0, 0.0, -0.0625, -0.25, -0.5]
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: off


def test_overlong_shaping_uses_a_prompts_own_smaller_budget():
    shaping = OverlongShaping(max_new_tokens=20, buffer_len=8, factor=1.0)
    long_for_its_prompt = sample("a", 1.0, response=range(10), cap=10)  # budget 10, free up to 2 tokens
    assert shaping.penalty(long_for_its_prompt) == -1.0
    assert shaping.penalty(sample("b", 1.0, response=range(10))) == 0.0  # budget 20, free up to 12


def test_opo_subtracts_the_length_weighted_mean_reward():
    # rewards 1, 0, 0 with lengths 1, 2, 5: baseline (1*1) / 8 = 0.125
    advantages = opo(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1, 2, 5]))
    assert advantages.tolist() == pytest.approx([0.875, -0.125, -0.125])


def test_opo_reaches_the_estimator_through_prepare_with_generated_lengths_only():
    group = [sample("a", 1.0, response=(4,)), sample("b", 0.0, response=(4, 5, 6))]
    group[1].response_mask = [1, 0, 0]  # two tool-output tokens: its generated length is 1, not 3
    batch = prepare_train_data([group], AdvantageConfig(estimator="opo"), shuffle=False, seed=0)
    by_id = {seq.rollout_id: max(seq.advantages, key=abs) for seq in batch.sequences}
    assert by_id == pytest.approx({"a": 0.5, "b": -0.5})  # equal lengths: baseline 0.5


def test_a_truncated_response_counts_in_the_baseline_but_is_not_trained():
    group = [sample("a", 1.0), sample("b", 0.0), sample("c", 0.0, finish="length")]
    batch = prepare_train_data([group], AdvantageConfig(estimator="drgrpo"), shuffle=False, seed=0, mask_truncated=True)
    assert [seq.rollout_id for seq in batch.sequences] == ["a", "b"]
    assert max(batch.sequences[0].advantages) == pytest.approx(1.0 - 1.0 / 3)  # mean over all three
    assert batch.info["truncated_masked_samples"] == 1.0


def rounds_of(rewards_by_round):
    """A stand-in for rollout: round r returns groups with the given rewards (already scored)."""
    asked = []

    def produce_round(round_index, prompts):
        asked.append(prompts)
        groups = [
            [sample(f"r{round_index}g{g}s{k}", reward, group=f"r{round_index}g{g}") for k, reward in enumerate(rewards)]
            for g, rewards in enumerate(rewards_by_round[round_index][:prompts])
        ]
        return ProduceResult.of(groups)

    return produce_round, asked


def test_dynamic_sampling_refills_at_the_observed_keep_rate_and_filters_the_surplus():
    flat, spread = (1.0, 1.0), (1.0, 0.0)
    produce_round, asked = rounds_of([[flat, spread, flat, flat], [spread] * 8])
    result = fill_batch(produce_round, target=4, max_rounds=5)
    # Round 0 kept 1 of 4 groups; 3 are missing at a keep rate of 1/4: round 1 draws min(4, 12) = 4.
    assert asked == [4, 4]
    status = {group[0].group_id: group[0].status for group in result.groups}
    assert [g for g, s in status.items() if s == Status.COMPLETED] == ["r0g1", "r1g0", "r1g1", "r1g2"]
    assert sorted(g for g, s in status.items() if s == Status.FILTERED) == ["r0g0", "r0g2", "r0g3", "r1g3"]
    assert result.counters == {
        "sampling/rounds": 2.0, "sampling/filtered_groups": 3.0, "sampling/surplus_groups": 1.0,
        "sampling/kept_groups": 4.0, "sampling/missing_groups": 0.0,
    }
    assert result.produced_samples == 16
    batch = prepare_train_data(result.groups, AdvantageConfig(), shuffle=False, seed=0)
    assert batch.info["filtered_groups"] == 4.0 and batch.info["skipped_groups"] == 0.0
    assert len(batch.sequences) == 8


def test_dynamic_sampling_stops_after_max_rounds_and_trains_what_it_has():
    produce_round, asked = rounds_of([[(0.0, 0.0)] * 4] * 3)
    result = fill_batch(produce_round, target=4, max_rounds=3)
    assert asked == [4, 4, 4]  # nothing kept yet: each round draws a full batch
    assert result.counters["sampling/missing_groups"] == 4.0
    assert all(s.status == Status.FILTERED for group in result.groups for s in group)


def test_a_real_step_reports_the_counters_and_keeps_filtered_groups_in_the_lake(tiny_model, reverse_data, tmp_path):
    """One real step with dynamic sampling and overlong shaping (budget 12, buffer 8, factor 0.5). The
    reward training used (each row's ``reward``, and the step's ``response/rewards/mean`` over the kept
    groups) must be the task's exact-match score plus DAPO's penalty computed here from the config:
    -0.5 x min(max(len - (12 - 8), 0), 8) / 8. The buffer starts at 4 tokens, inside the tiny model's
    usual 3-8 (a buffer of 4 starting at 8 was reached by no response of a run on 2026-12-04). Tried: deleting ``sample.reward += penalty`` in
    ``engine/rollout/production/produce.py::score`` (the payload still says the penalty) fails it."""
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, total_train_steps=1, train_batch_size=4, prompt_repeat_k=4,
        enable_evaluate=False, checkpoint_interval=-1, dynamic_sampling={"enable": True, "max_rounds": 3},
        reward={"function": "trellis.engine.tiny.reverse_task:score", "overlong_buffer_len": 8, "overlong_penalty_factor": 0.5},
        rollout={"max_new_tokens": 12},
    )
    with LocalRun(config) as run:
        run.run()
    with fsspec.open(f"{config.run_uri}/logs/metrics.jsonl", "r") as handle:
        metrics = next(r for r in map(json.loads, handle.read().splitlines()) if r["step"] == 1)
    rows = lake_rows(config)
    groups = {row["group_id"] for row in rows}
    assert metrics["sampling/rounds"] >= 1 and len(groups) >= 4
    filtered = {row["group_id"] for row in rows if row["status"] == "filtered"}
    assert metrics["sampling/filtered_groups"] + metrics["sampling/surplus_groups"] == len(filtered)
    assert metrics["response/filtered_groups"] == len(filtered)
    assert metrics["sampling/kept_groups"] + metrics["sampling/missing_groups"] == 4

    def expected_penalty(row):
        return -0.5 * min(max(row["response_len"] - (12 - 8), 0), 8) / 8

    def expected_reward(row):
        exact_match = 1.0 if row["response"].strip() == row["label"] else 0.0
        return exact_match + expected_penalty(row)

    assert all(row["status"] in ("completed", "filtered") for row in rows)
    penalised = [row for row in rows if expected_penalty(row) < 0]
    assert penalised, f"no response reached the buffer: the penalty went untried; lengths {sorted(r['response_len'] for r in rows)}"
    for row in rows:
        assert row["reward"] == pytest.approx(expected_reward(row)), (row["response_len"], row["response"], row["label"])
        assert json.loads(row["reward_payload"]).get("overlong_penalty", 0.0) == pytest.approx(expected_penalty(row))
    trained = [row for row in rows if row["status"] == "completed"]
    assert any(expected_penalty(row) < 0 for row in trained), "no trained response was penalised"
    assert metrics["response/rewards/mean"] == pytest.approx(sum(map(expected_reward, trained)) / len(trained))


def test_a_users_group_filter_drops_groups_in_process_and_a_filter_that_raises_keeps_them(tiny_model, reverse_data, tmp_path, caplog):
    """The user's rule (keep a group only if its prompt's word has an even number of letters) drops the
    others as FILTERED with the rule named, without dynamic sampling (nothing replaces them), and the
    ledger ends them as filtered. A rule that raises keeps every group and warns."""
    from helpers import ledger_check

    (tmp_path / "rules.py").write_text(
        "def even_words(group):\n"
        "    return len(group[0]['label']) % 2 == 0 and all('reward' in sample for sample in group)\n\n"
        "def broken(group):\n"
        "    raise KeyError('no such column')\n"
    )
    config = tiny_config(tiny_model, reverse_data, tmp_path / "even", total_train_steps=2, enable_evaluate=False, checkpoint_interval=-1,
                         dynamic_sampling={"group_filter": f"{tmp_path}/rules.py:even_words"})
    with LocalRun(config) as run:
        run.run()
    rows = lake_rows(config)
    kept = {row["label"] for row in rows if row["status"] == "completed"}
    dropped = [row for row in rows if row["status"] == "filtered"]
    assert kept and dropped and all(len(label) % 2 == 0 for label in kept)
    assert all(len(row["label"]) % 2 == 1 and row["error_msg"] == f"group_filter {tmp_path}/rules.py:even_words" for row in dropped)
    assert "filtered" in ledger_check(config)

    broken = tiny_config(tiny_model, reverse_data, tmp_path / "broken", total_train_steps=1, enable_evaluate=False, checkpoint_interval=-1,
                         dynamic_sampling={"group_filter": f"{tmp_path}/rules.py:broken"})
    with LocalRun(broken) as run:
        run.run()
    assert all(row["status"] == "completed" for row in lake_rows(broken))
    assert "group_filter" in caplog.text and "KeyError" in caplog.text and "the group is kept" in caplog.text
