"""The disaggregated trainer's producer and replay buffer on their own, with a scripted rollout
backend: how far ahead it runs, staleness, expiry, partial rollout across a pause, failure, resume."""

from __future__ import annotations

import threading
import time

import pytest

from trellis.engine.config.loading import load_config
from trellis.engine.data.prompts import PromptRecord
from trellis.engine.data.sampler import PromptSampler
from trellis.engine.rollout.agents.agent_loops import SingleTurnLoop
from trellis.engine.rollout.backends.base import Generation, in_order
from trellis.engine.rollout.production.producer import Producer, ProducerFailure
from trellis.engine.rollout.production.prompt_ledger import PromptLedger
from trellis.engine.rollout.rewards.runner import RewardRunner
from trellis.engine.storage.ledger import SINGLE_TASK

BATCH = 2
# A deadline for what takes the producer well under a second: waits end as soon as it is done, and a
# loaded machine does not fail them.
WAIT_S = 60.0


def reward_of_version(sample):
    """1.0 for responses from version 1 on (token 11), 0.0 before."""
    return 1.0 if "b" in sample["response"] else 0.0


class ScriptedRollout:
    """Answers prompt i with ``min(length, limits[i])`` tokens (10 under version 0, 11 after), one
    in turn, each sample coming out when it ends; ``abort`` stops at the next token, as the real
    backends do. With ``hold_at``, the responses still going after that many tokens wait there
    (``held`` is set) until an abort or a ``release``: a long response that ends when the test says,
    whatever the load on the machine, so no test races the clock."""

    def __init__(self, length: int = 4, fail: Exception | None = None, hold_at: int | None = None) -> None:
        self.policy_version, self.length, self.fail, self.hold_at = 0, length, fail, hold_at
        self.generating = threading.Event()
        self.held = threading.Event()
        self._abort = threading.Event()
        self._unheld = threading.Event()

    def generate(self, prompts, params, limits=None):
        return in_order(self.stream(prompts, params, limits), len(prompts))

    def stream(self, prompts, params, limits=None):
        if self.fail is not None:
            raise self.fail
        token = 10 if self.policy_version == 0 else 11
        targets = [min(self.length, limit) for limit in (limits or [params.max_new_tokens] * len(prompts))]
        made = 0
        self.generating.set()
        try:
            for made in range(1, max(targets) + 1):
                if self._abort.is_set():
                    made -= 1
                    break
                yield from ((i, self._generation(token, made, "length")) for i, t in enumerate(targets) if t == made)
                if made == self.hold_at and max(targets) > made:
                    self.held.set()
                    assert self._unheld.wait(timeout=2 * WAIT_S), "held for a pause or a release that never came"
            yield from ((i, self._generation(token, made, "abort")) for i, t in enumerate(targets) if t > made)
        finally:
            self.held.clear()
            self.generating.clear()

    @staticmethod
    def _generation(token: int, made: int, reason: str) -> Generation:
        return Generation([token] * made, [-0.5] * made, ("a" if token == 10 else "b") * made, reason)

    def abort(self):
        self._abort.set()
        self._unheld.set()

    def release(self):
        """Let held responses go on to their end."""
        self._unheld.set()

    def resume_generation(self):
        self._abort.clear()
        self._unheld.clear()


def make_producer(tmp_path, caps=(None,) * 6, max_new_tokens=4, dynamic_sampling=False, **replay_buffer):
    config = load_config(
        None, load_from=str(tmp_path / "m"), train_dataset={"path": str(tmp_path / "d")}, total_train_steps=10,
        dynamic_sampling={"enable": dynamic_sampling},
        train_batch_size=BATCH, prompt_repeat_k=2, trainer="disaggregated", rollout={"max_new_tokens": max_new_tokens},
        reward={"function": f"{__name__}:reward_of_version"}, replay_buffer=replay_buffer, work_dir=str(tmp_path),
    )
    prompts = [PromptRecord(index=i, messages=({"role": "user", "content": f"p{i}"},), prompt_ids=(1, 2, i), max_new_tokens=cap)
               for i, cap in enumerate(caps)]
    rewards = RewardRunner(config.reward)
    recorded = []
    sampler = PromptSampler(prompts, seed=0)
    producer = Producer(config, sampler=sampler, rewards=rewards,
                        agent_loop=SingleTurnLoop(lambda ids: "".join("a" if t == 10 else "b" for t in ids)),
                        record=lambda groups, round_index, part: recorded.append((round_index, len(groups))),
                        ledger=PromptLedger(config, {SINGLE_TASK: sampler}))
    return producer, rewards, recorded


def wait_until(condition, timeout=WAIT_S):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_on_policy_the_producer_makes_one_batch_then_waits_for_new_weights(tmp_path):
    producer, rewards, recorded = make_producer(tmp_path, max_staleness=0)
    backend = ScriptedRollout()
    try:
        producer.continue_produce(0, backend)
        first = producer.get_batch(1, timeout_s=WAIT_S)
        assert len(first.groups) == BATCH and first.expired  # nothing more without the weights of step 1
        assert first.counters["async/staleness_max"] == 0.0
        time.sleep(0.2)
        assert producer.buffer.count("completed") == 0  # held: step 2 needs the weights of step 1
        held = producer.get_batch(2, timeout_s=WAIT_S)
        assert held.groups == [] and held.expired  # the trainer has step 1's weights; the rollout has not
        producer.pause_produce(timeout_s=WAIT_S)
        backend.policy_version = 1
        producer.continue_produce(1, backend)
        second = producer.get_batch(2, timeout_s=WAIT_S)
        assert {s.policy_version for g in second.groups for s in g} == {1}
        assert all(s.reward == 1.0 for g in second.groups for s in g)
        assert sum(count for _, count in recorded) == 2 * BATCH  # every group entered the lake when scored
    finally:
        producer.shutdown()
        rewards.close()


def test_with_dynamic_sampling_flat_groups_reach_the_lake_but_never_the_buffer(tmp_path):
    """Every group of this rollout has equal rewards (one version, one token): all are filtered, so the
    producer keeps going and the trainer gets nothing."""
    producer, rewards, recorded = make_producer(tmp_path, max_staleness=0, dynamic_sampling=True)
    try:
        producer.continue_produce(0, ScriptedRollout())
        assert producer.get_batch(1, timeout_s=1.0) is None
        producer.pause_produce(timeout_s=WAIT_S)
        assert producer.buffer.count("completed") == 0
        assert producer.progress.filtered_groups == sum(count for _, count in recorded) >= BATCH
        resolved = producer.state_dict()["ledger_resolved"]  # for the ledger, with the next batch taken
        assert len(resolved) == producer.progress.filtered_groups and {row["status"] for row in resolved} == {"filtered"}
    finally:
        producer.shutdown()
        rewards.close()


def test_one_step_off_policy_the_producer_runs_one_batch_ahead(tmp_path):
    producer, rewards, _ = make_producer(tmp_path, max_staleness=1)
    try:
        producer.continue_produce(0, ScriptedRollout())
        wait_until(lambda: producer.buffer.count("completed") == 2 * BATCH)
        time.sleep(0.2)
        assert producer.buffer.count("completed") == 2 * BATCH  # and no further
        assert producer.get_batch(1, timeout_s=WAIT_S).counters["async/staleness_max"] == 0.0
        assert producer.get_batch(2, timeout_s=WAIT_S).counters["async/staleness_max"] == 1.0
    finally:
        producer.shutdown()
        rewards.close()


def test_a_pause_keeps_the_interrupted_samples_and_the_new_weights_finish_them(tmp_path):
    """Partial rollout: the pause interrupts generation mid-response; after the sync the same samples
    go on from their tokens, which record the version that made each. The responses stop at 2 of
    their 4 tokens until aborted, so only an interrupting pause returns (one that waited for them
    would time out: tried by removing the pause's abort); no clock is raced."""
    producer, rewards, _ = make_producer(tmp_path, max_staleness=1, enable_partial_rollout=True,
                                         mask_offpolicy_in_partial_rollout=True)
    backend = ScriptedRollout(length=4, hold_at=2)
    try:
        producer.continue_produce(0, backend)
        wait_until(backend.held.is_set)
        producer.pause_produce(timeout_s=WAIT_S)
        assert not backend.generating.is_set()  # interrupted, not waited for
        assert producer.buffer.count("pending") == 2 * BATCH  # a round takes all the room staleness leaves
        backend.policy_version = 1
        backend.hold_at = None
        producer.continue_produce(1, backend)
        batch = producer.get_batch(1, timeout_s=WAIT_S)
        versions = [s.response_versions for g in batch.groups for s in g]
        assert all(v == [0, 0, 1, 1] for v in versions), versions
        assert all(s.response_mask == [int(v == 1) for v in s.response_versions] for g in batch.groups for s in g)
        assert batch.counters["async/resumed_partial_samples"] == 2 * BATCH * 2
        assert batch.counters["async/staleness_max"] == 0.0  # trained at step 1, oldest token from version 0
    finally:
        producer.shutdown()
        rewards.close()


def test_a_failing_producer_reaches_the_trainer_with_its_cause(tmp_path):
    producer, rewards, _ = make_producer(tmp_path)
    try:
        producer.continue_produce(0, ScriptedRollout(fail=RuntimeError("rollout worker lost")))
        with pytest.raises(ProducerFailure, match="RuntimeError: rollout worker lost"):
            producer.get_batch(1, timeout_s=WAIT_S)
    finally:
        producer.shutdown()
        rewards.close()


def test_the_buffer_survives_a_checkpoint_and_stale_groups_expire(tmp_path):
    producer, rewards, _ = make_producer(tmp_path, max_staleness=1)
    try:
        producer.continue_produce(0, ScriptedRollout())
        wait_until(lambda: producer.buffer.count("completed") == 2 * BATCH)
        producer.pause_produce(timeout_s=WAIT_S)
        state = producer.state_dict()
        restored, restored_rewards, _ = make_producer(tmp_path, max_staleness=1)
        restored.load_state_dict(state)
        assert restored.buffer.count("completed") == 2 * BATCH
        assert restored.buffer.refresh(4) == 2 * BATCH  # version 0 trained at step 4: staleness 3 >= 2
        assert restored.buffer.count("pending") == 2 * BATCH and restored.buffer.count("completed") == 0
        restored_rewards.close()
    finally:
        producer.shutdown()
        rewards.close()


def test_groups_that_finish_early_are_trained_while_the_long_ones_go_on(tmp_path):
    """A long tail: 4 of the 6 prompts cap their responses at 1 token, 2 at 40, which stop at their
    2nd token until a pause. The first batch comes from the short groups while the long ones are still
    generating, and a pause keeps those."""
    producer, rewards, recorded = make_producer(tmp_path, caps=(1, 1, 1, 1, 40, 40), max_new_tokens=40, max_staleness=1,
                                                enable_partial_rollout=True)
    backend = ScriptedRollout(length=40, hold_at=2)
    try:
        producer.continue_produce(0, backend)
        batch = producer.get_batch(1, timeout_s=WAIT_S)
        wait_until(backend.held.is_set)  # the long responses are under way, and end only with the pause
        assert [len(s.response_ids) for g in batch.groups for s in g] == [1] * 2 * BATCH
        producer.pause_produce(timeout_s=WAIT_S)
        interrupted = [s for g in producer.buffer.take_pending(2 * BATCH) for s in g]
        assert interrupted and all(0 < len(s.response_ids) < 40 and s.finish_reason == "abort" for s in interrupted)
        assert sum(count for _, count in recorded) >= BATCH  # what was delivered entered the lake first
    finally:
        producer.shutdown()
        rewards.close()


def test_a_group_continued_across_syncs_that_arrives_too_stale_is_not_trained(tmp_path):
    """On-policy (max_staleness 0) with partial rollout: two groups begun under version 0 are paused,
    continued under version 1 and end while step 2 waits for its batch (held until then). Their
    oldest tokens are 1 version stale at step 2, so they expire instead of being trained; step 2
    trains the groups begun under version 1."""
    producer, rewards, _ = make_producer(tmp_path, caps=(40,) * 6, max_new_tokens=40, max_staleness=0,
                                         enable_partial_rollout=True)
    backend = ScriptedRollout(length=40, hold_at=5)
    try:
        producer.continue_produce(0, backend)
        wait_until(backend.held.is_set)
        producer.pause_produce(timeout_s=WAIT_S)
        backend.policy_version = 1
        backend.hold_at = 10
        assert not backend.generating.is_set()
        producer.continue_produce(1, backend)
        wait_until(backend.held.is_set)  # the interrupted groups are being continued, out of the buffer

        def release_once_step_2_waits():
            wait_until(lambda: producer.progress.consumer_step >= 2)
            backend.release()  # what ends now reaches the buffer while get_batch(2) waits

        releaser = threading.Thread(target=release_once_step_2_waits, daemon=True)
        releaser.start()
        batch = producer.get_batch(2, timeout_s=WAIT_S)
        releaser.join(timeout=WAIT_S)
        assert batch.counters["async/resumed_partial_samples"] == 2 * 2  # the two paused groups went on
        assert batch.counters["async/staleness_max"] == 0.0
        assert {s.oldest_version for g in batch.groups for s in g} == {1}
        assert batch.counters["async/expired_groups"] >= 2
        # goodput: the expired groups' responses were thrown away, 40 tokens a sample at least
        assert batch.counters["async/discarded_tokens/expired"] >= 40 * batch.counters["async/expired_groups"]
    finally:
        producer.shutdown()
        rewards.close()


def _generated(groups, version):
    for group in groups:
        for sample in group:
            sample.response_ids, sample.response_versions, sample.policy_version = [7, 7], [version] * 2, version
    return groups


def test_the_tail_lane_holds_expired_groups_until_enough_gather_then_trains_them_first():
    """tail_batch_trigger_size 3: expired groups wait (none is generated again) until 3 have gathered;
    they then come out together, and once generated again they are trained before older groups."""
    from trellis.engine.rollout.production.produce import new_groups
    from trellis.engine.rollout.production.replay_buffer import ReplayBuffer

    prompts = [(0, PromptRecord(index=i, messages=({"role": "user", "content": f"p{i}"},), prompt_ids=(1, i))) for i in range(5)]
    groups = new_groups(prompts, repeat=2, version=0, train_step=1, id_prefix="r")
    buffer = ReplayBuffer("sync", stale_after=1, tail_trigger=3)
    for group in _generated(groups[:2], version=0):
        buffer.put(group, "completed")
    assert buffer.refresh(step=2) == 2  # version 0 at step 2: staleness 1, expired
    assert buffer.count("tail") == 2 and all(not s.response_ids for g in groups[:2] for s in g)
    assert buffer.take_pending(10) == [] and buffer.take_tail(10) == []  # 2 < 3: they wait

    buffer.put(_generated([groups[2]], version=0)[0], "completed")
    buffer.refresh(step=2)
    restored = ReplayBuffer("sync", stale_after=1, tail_trigger=3)
    restored.load_state_dict(buffer.state_dict(keep_generations=False))  # the lane survives a checkpoint
    tail = restored.take_tail(10)
    assert [g[0].group_id for g in tail] == [g[0].group_id for g in groups[:3]] and restored.tail_rounds == 1

    restored.put(_generated([groups[3]], version=1)[0], "completed")  # an ordinary group, buffered first
    for group in _generated(tail, version=1):
        restored.put(group, "completed")
    taken = restored.take(3)
    assert [g[0].group_id for g in taken] == [g[0].group_id for g in groups[:3]]  # the tail lane first
    assert restored.tail_trained == 3 and restored.take(1)[0][0].group_id == groups[3][0].group_id


def test_a_tail_round_draws_no_new_prompt(tmp_path):
    """The producer's round once the lane is full: the expired groups, nothing drawn from the dataset."""
    producer, rewards, _ = make_producer(tmp_path, max_staleness=0, tail_batch_trigger_size=2)
    try:
        fresh, _ = producer._next_round(BATCH)
        drawn = producer._sampler.state_dict()
        for group in _generated(fresh, version=0):
            producer.buffer.put(group, "completed")
        producer.buffer.refresh(step=2)
        tail, _ = producer._next_round(2 * BATCH)
        assert [g[0].group_id for g in tail] == [g[0].group_id for g in fresh]
        assert producer._sampler.state_dict() == drawn  # no prompt drawn in the tail round
    finally:
        rewards.close()
