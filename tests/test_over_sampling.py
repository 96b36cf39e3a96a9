"""Colocated over-sampling on its own, with the scripted rollout of ``test_producer``: a step launches
more groups than it trains, trains the first to end, stops the rest and carries them (continued with
partial rollout, restarted without), and token staleness expires what waited too long; the ledger sees
every carried group as open."""

from __future__ import annotations

from test_producer import ScriptedRollout, reward_of_version

from trellis.engine.config.loading import load_config
from trellis.engine.data.prompts import PromptRecord
from trellis.engine.data.sampler import PromptSampler
from trellis.engine.rollout.agents.agent_loops import SingleTurnLoop
from trellis.engine.rollout.production.over_sampling import OverSampler
from trellis.engine.rollout.production.prompt_ledger import PromptLedger
from trellis.engine.rollout.rewards.runner import RewardRunner
from trellis.engine.storage.ledger import SINGLE_TASK

BATCH = 2
CAPS = (1, 4, 1, 4, 4, 1, 4, 1)  # prompt i's response cap; the sampler draws them in order

assert reward_of_version  # the configs below name it by module


def make_over_sampler(tmp_path, **replay_buffer):
    config = load_config(
        None, load_from=str(tmp_path / "m"), train_dataset={"path": str(tmp_path / "d")}, total_train_steps=10,
        train_batch_size=BATCH, prompt_repeat_k=2, rollout={"max_new_tokens": 4},
        reward={"function": "test_producer:reward_of_version"}, work_dir=str(tmp_path),
        replay_buffer={"over_sample_threshold": 1.0, **replay_buffer},
    )
    prompts = [PromptRecord(index=i, messages=({"role": "user", "content": f"p{i}"},), prompt_ids=(1, 2, i), max_new_tokens=cap)
               for i, cap in enumerate(CAPS)]
    rewards = RewardRunner(config.reward)
    recorded = []
    sampler = PromptSampler(prompts, seed=0, shuffle=False)
    over_sampler = OverSampler(
        config, sampler=sampler, rewards=rewards, agent_loop=SingleTurnLoop(lambda ids: "".join("a" if t == 10 else "b" for t in ids)),
        record=lambda groups, round_index, part: recorded.append(len(groups)), ledger=PromptLedger(config, {SINGLE_TASK: sampler}),
    )
    return over_sampler, rewards, recorded


def prompts_of(groups):
    return [group[0].prompt_index for group in groups]


def test_a_step_trains_the_first_groups_to_end_and_continues_the_rest_with_the_next_weights(tmp_path):
    """Step 1 launches prompts 0-3 (twice the batch); 0 and 2 end after one token and are trained, and
    generation stops there: 1 and 3 wait with one token each (tried: without the stop, step 1 waits for
    all four). Step 2 continues them with version 1 beside fresh prompts 4 and 5; the first two to end
    are trained, and the third waits, completed, for step 3, where its oldest token (version 0) is too
    stale for max_staleness 1: it expires and is generated again. The ledger holds every group the
    batch left behind as open."""
    over_sampler, rewards, recorded = make_over_sampler(tmp_path, max_staleness=1, enable_partial_rollout=True)
    backend = ScriptedRollout(length=4)
    try:
        first = over_sampler.produce_step(1, backend)
        assert prompts_of(first.groups) == [0, 2] and not first.expired
        assert over_sampler.produce_step(1, backend) is first  # a step asked again gets the same groups
        pending = [g.samples for g in over_sampler.buffer.groups if g.status == "pending"]
        assert prompts_of(pending) == [1, 3] and all(s.response_ids == [10] for g in pending for s in g)
        assert sorted((p, e) for _, e, p, _ in first.ledger.open) == [(1, 0), (3, 0)]

        backend.policy_version = 1
        second = over_sampler.produce_step(2, backend)
        assert prompts_of(second.groups) == [5, 1]  # in the order they ended
        continued = second.groups[1]
        assert all(s.response_versions == [0, 1, 1, 1] for s in continued)
        assert second.counters["async/staleness_max"] == 1.0 and second.counters["async/resumed_partial_samples"] == 4
        left = {g.samples[0].prompt_index: g.status for g in over_sampler.buffer.groups}
        assert left == {3: "completed", 4: "pending"}  # 3 ended beside 1; 4 stopped at 3 of its 4 tokens
        assert sorted(p for _, _, p, _ in second.ledger.open) == [3, 4]

        backend.policy_version = 2
        third = over_sampler.produce_step(3, backend)
        assert third.counters["async/expired_groups"] == 1.0
        assert third.counters["async/discarded_tokens/expired"] == 2 * 4  # prompt 3's two responses
        assert 3 not in prompts_of(third.groups) or all(s.response_versions == [2] * 4 for g in third.groups for s in g if s.prompt_index == 3)
        assert all(max(s.response_versions) == 2 for g in third.groups for s in g)
        assert sum(recorded) == over_sampler.progress.produced_groups  # every ended group reached the lake
    finally:
        rewards.close()


def test_without_partial_rollout_a_stopped_group_starts_again_from_its_prompt(tmp_path):
    """The tokens the stop cut off are thrown away (and counted); the prompts are not: they are generated
    again, whole, at the next step."""
    over_sampler, rewards, _ = make_over_sampler(tmp_path)
    backend = ScriptedRollout(length=4)
    try:
        first = over_sampler.produce_step(1, backend)
        assert prompts_of(first.groups) == [0, 2]
        assert first.counters["async/discarded_tokens/aborted"] == 2 * 2 * 1  # prompts 1 and 3, two samples, a token each
        pending = [g.samples for g in over_sampler.buffer.groups if g.status == "pending"]
        assert prompts_of(pending) == [1, 3] and all(not s.response_ids for g in pending for s in g)
        backend.policy_version = 1
        second = over_sampler.produce_step(2, backend)
        assert all(s.response_versions == [1] * len(s.response_ids) for g in second.groups for s in g)
        assert second.counters["async/resumed_partial_samples"] == 0
    finally:
        rewards.close()


def test_the_buffer_of_an_over_sampling_run_survives_a_checkpoint(tmp_path):
    """What a step left behind (a stopped group, with its tokens) is in the controller's checkpoint and
    continued after a restore; a restored sampler does not draw those prompts again."""
    over_sampler, rewards, _ = make_over_sampler(tmp_path, max_staleness=1, enable_partial_rollout=True)
    restored, restored_rewards, _ = make_over_sampler(tmp_path, max_staleness=1, enable_partial_rollout=True)
    backend = ScriptedRollout(length=4)
    try:
        over_sampler.produce_step(1, backend)
        restored.load_state_dict(over_sampler.state_dict())
        restored._sampler.load_state_dict(over_sampler._sampler.state_dict())
        backend.policy_version = 1
        second = restored.produce_step(2, backend)
        assert prompts_of(second.groups) == [5, 1] and restored._sampler.drawn == (0, 6)
    finally:
        rewards.close()
        restored_rewards.close()


def test_an_over_sampling_run_resumes_and_accounts_for_every_prompt(tiny_model, reverse_data, tmp_path):
    """The bundled task in process: 8 groups trained of 12 launched per step, stopped groups continued
    within max_staleness 1; a crash after step 2 resumes from its checkpoint (the buffer with it). No
    trained token is staler than the bound, some responses were continued across a sync, and
    `trellis ledger check` finds every prompt drawn open or ended once."""
    import duckdb

    from helpers import ledger_check, logged_metrics, run_local, tiny_config

    config = tiny_config(
        tiny_model, reverse_data, tmp_path, train_batch_size=8, enable_evaluate=False, enable_initial_evaluate=False,
        replay_buffer={"over_sample_threshold": 0.5, "max_staleness": 1, "enable_partial_rollout": True},
    )
    run_local(config, steps=2)
    assert max(logged_metrics(config)) == 2
    run_local(config, resume=True)
    metrics = logged_metrics(config)
    assert sorted(metrics) == [1, 2, 3, 4]
    assert all(metrics[step]["async/staleness_max"] <= 1 for step in metrics)
    assert sum(metrics[step]["async/resumed_partial_samples"] > 0 for step in metrics) >= 1, metrics
    trained = f"{config.run_uri}/trajectories/split=train/*/*.parquet"
    per_step, stalest = duckdb.sql(
        f"SELECT count(DISTINCT group_id) / count(DISTINCT train_step), max(train_step - version - 1) "
        f"FROM (SELECT train_step, group_id, unnest(response_versions) AS version FROM read_parquet('{trained}'))"
    ).fetchall()[0]
    assert per_step == 8 and stalest <= 1
    ledger_check(config)


def test_over_sampling_through_the_flow_on_a_cluster(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """The same on Ray actors through Prefect flow runs: the stop reaches the rollout worker's actor while
    it streams (its control lane), and the run's ledger accounts for every prompt."""
    from helpers import ledger_check, logged_metrics, tiny_config

    from trellis.flows.rl_train import rl_train

    config = tiny_config(
        tiny_model, reverse_data, tmp_path, train_batch_size=8, total_train_steps=3, enable_evaluate=False,
        enable_initial_evaluate=False, checkpoint_interval=-1, cluster=ray_cluster["cluster"], experiment_name="over_flow",
        replay_buffer={"over_sample_threshold": 0.5, "max_staleness": 1, "enable_partial_rollout": True},
    )
    rl_train(config)
    metrics = logged_metrics(config)
    assert sorted(metrics) == [1, 2, 3] and all(metrics[step]["async/staleness_max"] <= 1 for step in metrics)
    assert metrics[3]["async/produced_groups"] >= 3 * 8
    ledger_check(config)
