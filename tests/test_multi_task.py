"""A multi-task run: two tasks with their own datasets, agent loops (the tool loop and the single-turn
loop), reward functions, sampling settings and weights, mixed in each batch; per-task metrics in
training and evaluation; the mix resumes exactly."""

import json

import pytest

from engine.config.loading import ConfigError, load_config
from engine.run.local import LocalRun
from engine.tiny import reverse_task
from helpers import lake_rows, logged_metrics


@pytest.fixture(scope="module")
def reverse_prompts(tmp_path_factory):
    root = tmp_path_factory.mktemp("reverse")
    return {
        "train": reverse_task.write_dataset(root / "train.parquet", 512, seed=0),
        "eval": reverse_task.write_dataset(root / "eval.parquet", 64, seed=reverse_task.EVAL_SEED_OFFSET),
    }


def mixed_config(lookup, reverse_prompts, work_dir, **changes):
    tasks = [
        {"name": "lookup", "weight": 3.0,  # the run's agent (the tool loop) and reward
         "train_dataset": {"path": str(lookup["train"]), "max_prompt_length": 64},
         "eval_dataset": {"path": str(lookup["eval"]), "max_prompt_length": 64, "limit": 32}},
        {"name": "reverse", "weight": 1.0, "agent": {"loop": "single_turn"},
         "reward": {"function": "engine.tiny.reverse_task:score"}, "temperature": 0.0, "max_new_tokens": 12,
         "train_dataset": {"path": str(reverse_prompts["train"]), "max_prompt_length": 64},
         "eval_dataset": {"path": str(reverse_prompts["eval"]), "max_prompt_length": 64, "limit": 16}},
    ]
    fields = dict(
        load_from=str(lookup["model"]), train_dataset=None, eval_dataset=None, tasks=tasks, work_dir=str(work_dir),
        total_train_steps=4, evaluate_step=4, checkpoint_interval=2, enable_initial_evaluate=False,
    )
    return load_config("configs/tiny_lookup.yaml", **{**fields, **changes})


def test_two_tasks_mix_by_weight_each_with_its_loop_reward_and_sampling(lookup, reverse_prompts, tmp_path):
    config = mixed_config(lookup, reverse_prompts, tmp_path)
    with LocalRun(config) as run:
        run.run()

    rows = lake_rows(config)
    groups = {row["group_id"]: row for row in rows}
    by_task = {name: [row for row in groups.values() if row["task_name"] == name] for name in ("lookup", "reverse")}
    assert len(groups) == 4 * 16
    assert 36 <= len(by_task["lookup"]) <= 58, "weights 3:1 over 64 groups"  # binomial(64, 0.75): 48 +- 3.5
    lookup_rows = [row for row in rows if row["task_name"] == "lookup"]
    reverse_rows = [row for row in rows if row["task_name"] == "reverse"]
    assert all(json.loads(row["agent"])["loop"] == "tool" for row in lookup_rows)
    assert all(row["agent"] is None and row["response_len"] <= 12 for row in reverse_rows)
    # The reverse task samples greedily (its own temperature): a group's responses are all alike.
    for group_id in {row["group_id"] for row in reverse_rows}:
        assert len({tuple(row["response_ids"]) for row in reverse_rows if row["group_id"] == group_id}) == 1
    assert len({tuple(row["response_ids"]) for row in lookup_rows}) > len(lookup_rows) // 8

    metrics = logged_metrics(config)
    for step in range(1, 5):
        drawn = [row["task_name"] for row in groups.values() if row["train_step"] == step]
        assert metrics[step]["response/lookup/groups"] == drawn.count("lookup")
        assert metrics[step]["response/lookup/groups"] + metrics[step]["response/reverse/groups"] == 16
        assert "response/lookup/rewards/mean" in metrics[step] and "response/reverse/response_len/mean" in metrics[step]
    assert metrics[4]["eval/lookup/samples"] == 32 and metrics[4]["eval/reverse/samples"] == 16
    assert 0.0 <= metrics[4]["eval/lookup/accuracy"] <= 1.0


def test_a_resumed_multi_task_run_draws_what_an_uninterrupted_one_does(lookup, reverse_prompts, tmp_path):
    whole = mixed_config(lookup, reverse_prompts, tmp_path / "whole", total_train_steps=3, enable_evaluate=False, checkpoint_interval=-1)
    with LocalRun(whole) as run:
        run.run()
    first = mixed_config(lookup, reverse_prompts, tmp_path / "resumed", total_train_steps=2, enable_evaluate=False)
    with LocalRun(first) as run:
        run.run()
    rest = mixed_config(lookup, reverse_prompts, tmp_path / "resumed", total_train_steps=3, enable_evaluate=False, auto_resume=True)
    with LocalRun(rest, resume=True) as run:
        run.run()

    def prompts_at_step_3(config):
        return sorted((row["task_name"], row["prompt_index"]) for row in lake_rows(config) if row["train_step"] == 3)

    assert prompts_at_step_3(rest) == prompts_at_step_3(whole)


def test_a_multi_task_config_says_what_is_wrong(lookup, reverse_prompts, tmp_path):
    with pytest.raises(ConfigError) as error:
        mixed_config(lookup, reverse_prompts, tmp_path, train_dataset={"path": str(lookup["train"])})
    assert "leave the top-level ones unset" in str(error.value)
    config = mixed_config(lookup, reverse_prompts, tmp_path)
    twice = [config.tasks[0].model_dump(), config.tasks[0].model_dump()]
    with pytest.raises(ConfigError, match="distinct names"):
        mixed_config(lookup, reverse_prompts, tmp_path, tasks=twice)
    too_long = [{**config.tasks[1].model_dump(), "max_new_tokens": 400}]
    with pytest.raises(ConfigError, match=r"tasks\[reverse\].max_new_tokens=400 exceeds"):
        mixed_config(lookup, reverse_prompts, tmp_path, tasks=too_long)


def test_the_asynchronous_trainer_mixes_tasks_too(lookup, reverse_prompts, tmp_path):
    config = mixed_config(lookup, reverse_prompts, tmp_path, trainer="disaggregated", total_train_steps=3,
                          enable_evaluate=False, checkpoint_interval=-1, replay_buffer={"kind": "async", "max_staleness": 1})
    with LocalRun(config) as run:
        run.run()
    rows = lake_rows(config)
    assert {row["task_name"] for row in rows} == {"lookup", "reverse"}
    assert all(json.loads(row["agent"])["loop"] == "tool" for row in rows if row["task_name"] == "lookup")
    assert all(row["agent"] is None for row in rows if row["task_name"] == "reverse")
    assert any("response/lookup/groups" in logged_metrics(config)[step] for step in (1, 2, 3))
