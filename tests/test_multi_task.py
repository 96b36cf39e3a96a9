"""A multi-task run: two tasks with their own datasets, agent loops (the tool loop and the single-turn
loop), reward functions, sampling settings and weights, mixed in each batch; per-task metrics in
training and evaluation; the mix resumes exactly."""

import json
import math
from collections import Counter

import pytest

from trellis.engine.config.loading import ConfigError, load_config
from trellis.engine.run.local import LocalRun
from trellis.engine.storage.checkpoints import load_object
from trellis.engine.storage.store import Store
from trellis.engine.tiny import reverse_task
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
         "reward": {"function": "trellis.engine.tiny.reverse_task:score"}, "temperature": 0.0, "max_new_tokens": 12,
         "train_dataset": {"path": str(reverse_prompts["train"]), "max_prompt_length": 64},
         "eval_dataset": {"path": str(reverse_prompts["eval"]), "max_prompt_length": 64, "limit": 16}},
    ]
    fields = dict(
        load_from=str(lookup["model"]), train_dataset=None, eval_dataset=None, tasks=tasks, work_dir=str(work_dir),
        total_train_steps=4, evaluate_step=4, checkpoint_interval=2, enable_initial_evaluate=False,
    )
    return load_config("configs/tiny_lookup.yaml", **{**fields, **changes})


# Many small groups (2 samples each) so that a count of groups can tell the weights 3:1 from others.
MANY_GROUPS = dict(train_batch_size=48, prompt_repeat_k=2)


def binomial(n: int, p: float, k: int) -> float:
    return math.comb(n, k) * p**k * (1 - p) ** (n - k)


def assert_drawn_by_weight(lookup_groups: int, groups: int, share: float = 0.75) -> None:
    """``lookup_groups`` of ``groups`` is a plausible Binomial(groups, 3/4) count: outside the interval
    that leaves at most 1e-4 of that law's mass on each side (a right mix fails one seed in ~7,000), and
    the interval is narrow enough that uniform weights (1/2) would fall inside it less than 1% of the
    time, 3:1 reversed (1/4) never: the bound fails for wrong weights and holds for the right ones."""
    low, mass = 0, 0.0
    while mass + binomial(groups, share, low) <= 1e-4:
        mass, low = mass + binomial(groups, share, low), low + 1
    high, mass = groups, 0.0
    while mass + binomial(groups, share, high) <= 1e-4:
        mass, high = mass + binomial(groups, share, high), high - 1
    uniform_inside = sum(binomial(groups, 0.5, k) for k in range(low, high + 1))
    assert uniform_inside < 0.01, f"{groups} groups cannot tell 3:1 from 1:1 (bound {low}..{high})"
    assert low <= lookup_groups <= high, f"{lookup_groups} of {groups} groups are lookup's; weights 3:1 allow {low}..{high}"


def test_two_tasks_mix_by_weight_each_with_its_loop_reward_and_sampling(lookup, reverse_prompts, tmp_path):
    """Tried: uniform task weights in ``MixedSampler`` (``torch.ones_like(self._weights)``) fails the
    mix; each task's eval accuracy is checked against its own rows of the eval lake."""
    config = mixed_config(lookup, reverse_prompts, tmp_path, **MANY_GROUPS)
    with LocalRun(config) as run:
        run.run()

    rows = lake_rows(config)
    groups = {row["group_id"]: row for row in rows}
    by_task = {name: [row for row in groups.values() if row["task_name"] == name] for name in ("lookup", "reverse")}
    assert len(groups) == 4 * 48
    assert_drawn_by_weight(len(by_task["lookup"]), len(groups))
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
        assert metrics[step]["response/lookup/groups"] + metrics[step]["response/reverse/groups"] == 48
        assert "response/lookup/rewards/mean" in metrics[step] and "response/reverse/response_len/mean" in metrics[step]
    assert metrics[4]["eval/lookup/samples"] == 32 and metrics[4]["eval/reverse/samples"] == 16
    evaluated = [row for row in lake_rows(config, "eval") if row["train_step"] == 4]
    for task in ("lookup", "reverse"):
        mine = [row for row in evaluated if row["task_name"] == task]
        correct = sum(row["status"] == "completed" and row["reward"] > 0.5 for row in mine)
        assert metrics[4][f"eval/{task}/accuracy"] == correct / len(mine), task


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
    """The producer's draws follow the weights: counted where nothing is lost to timing, in the sampler
    state of the last step's checkpoint (every group drawn, in flight or not); the lake's trained
    groups are among them, and each step's per-task metrics count its trained groups. A step's batch
    need not mix the tasks by weight (the producer generates one task after the other and the trainer
    takes groups as they complete: step 1 here is all lookup). Tried: uniform task weights in
    ``MixedSampler`` fails it."""
    config = mixed_config(lookup, reverse_prompts, tmp_path, trainer="disaggregated", total_train_steps=3,
                          enable_evaluate=False, checkpoint_interval=3, replay_buffer={"kind": "async", "max_staleness": 1},
                          **MANY_GROUPS)
    with LocalRun(config) as run:
        run.run()
    rows = lake_rows(config)
    assert all(json.loads(row["agent"])["loop"] == "tool" for row in rows if row["task_name"] == "lookup")
    assert all(row["agent"] is None for row in rows if row["task_name"] == "reverse")

    sampler = load_object(Store(f"{config.run_uri}/checkpoints/step-000003/controller.pt"))["sampler"]
    drawn = {task: sampler["tasks"][task]["consumed"] for task in ("lookup", "reverse")}
    assert drawn["lookup"] + drawn["reverse"] >= 3 * 48
    assert_drawn_by_weight(drawn["lookup"], drawn["lookup"] + drawn["reverse"])
    groups = {row["group_id"]: row for row in rows}
    metrics = logged_metrics(config)
    for task in ("lookup", "reverse"):
        assert 0 < sum(row["task_name"] == task for row in groups.values()) <= drawn[task], task
    for step in (1, 2, 3):
        trained = {task: sum(row["task_name"] == task and row["train_step"] == step for row in groups.values()) for task in drawn}
        for task, count in trained.items():  # per-task figures only for a batch that mixes tasks
            assert metrics[step].get(f"response/{task}/groups") == (count if all(trained.values()) else None), (task, step)


def test_the_exact_mix_splits_every_batch_by_weight_and_small_draws_add_up():
    """Weights 3:1 (as XTuner splits a batch): a draw of 8 is 6 + 2, draws of one keep every prefix within a
    group of 3:1,
    and a resumed sampler continues the same order; the random mix draws by probability instead."""
    from types import SimpleNamespace

    from trellis.engine.data.sampler import PromptSampler
    from trellis.engine.rollout.production.task_mix import MixedSampler, _Task

    def sampler(mix: str) -> MixedSampler:
        tasks = [_Task(SimpleNamespace(name=name, weight=weight), PromptSampler([f"{name}{i}" for i in range(100)], seed=0), None, [], None, None)
                 for name, weight in (("a", 3.0), ("b", 1.0))]
        return MixedSampler(tasks, seed=0, mix=mix)

    exact = sampler("exact")
    assert Counter(item[1][0] for item in exact.draw(8)) == {"a": 6, "b": 2}
    singles = [exact.draw(1)[0][1][0] for _ in range(8)]
    assert singles == ["a", "a", "b", "a", "a", "a", "b", "a"]  # each to the task furthest behind its share of all draws
    resumed = sampler("exact")
    resumed.load_state_dict(exact.state_dict())
    assert [resumed.draw(1)[0][1][0] for _ in range(4)] == [exact.draw(1)[0][1][0] for _ in range(4)]
    randomly = sampler("random")
    drawn = Counter(item[1][0] for _ in range(50) for item in randomly.draw(8))
    assert_drawn_by_weight(drawn["a"], 400)
