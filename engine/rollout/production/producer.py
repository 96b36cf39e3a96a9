"""The disaggregated trainer's background producer: on the rollout side, it keeps drawing prompts,
generating and scoring whole groups into the replay buffer while the trainer trains.

How far ahead it may run is what bounds staleness. With the rollout serving the weights of step m,
the trainer next asking for step c, and ``stale_after`` = (max_staleness + 1) x sync_weights_interval,
the producer keeps at most ``train_batch_size x (m + stale_after - c + 1)`` completed groups ready:
every group it makes is trained with staleness below the bound. When that quota is spent it holds
until the weights move on; a trainer that is itself ahead of the rollout then gets an empty "expired"
batch, which tells it to sync first (XTuner's empty EXPIRED_BATCH).

``pause_produce`` (before a weight sync) interrupts the generation in progress with partial rollout
(what each sample has is kept and continued with the new weights), or waits for it otherwise.
A failure of the producer (a lost rollout worker, say) puts the groups it was generating back in the
buffer, stops it and reaches the trainer at its next ``get_batch``; ``continue_produce`` starts it
again (after the lost worker is replaced).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from trellis.engine.rollout.rewards.shaping import OverlongShaping
from trellis.engine.config import TrellisConfig
from trellis.engine.data.prompts import PromptRecord
from trellis.engine.data.sampler import PromptSampler
from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.rollout.agents.base import AgentLoop
from trellis.engine.rollout.backends.base import RolloutBackend
from trellis.engine.rollout.production.dynamic_sampling import filter_flat_groups
from trellis.engine.rollout.production.user_hooks import GroupFilter
from trellis.engine.rollout.production.prompt_ledger import PromptLedger
from trellis.engine.rollout.production.produce import (
    ProduceResult,
    new_groups,
    sampling_params,
    score,
    step_seed,
)
from trellis.engine.rollout.production.replay_buffer import ReplayBuffer, staleness
from trellis.engine.rollout.rewards.runner import RewardRunner
from trellis.engine.storage.ledger import LedgerEntries


class ProducerFailure(RuntimeError):
    """The background producer stopped for good; the message carries its cause."""


@dataclass(frozen=True)
class TakenBatch:
    groups: list[list[RolloutSample]]
    expired: bool  # the producer is held back by staleness: sync weights before it can go on
    pause_s: float  # time spent pausing the producer since the previous batch
    counters: dict[str, float]
    produce_s: float = 0.0  # generating and scoring, since the previous batch
    produced_samples: int = 0
    produced_tokens: int = 0
    ledger: LedgerEntries | None = None  # with a batch of groups: what the ledger records beside them

    def as_produced(self) -> ProduceResult:
        """What ``produce_batch`` returns for a colocated step; its counters carry the ``async/*`` figures."""
        produced = ProduceResult.of(self.groups, produce_time_s=self.produce_s)
        produced.produced_samples, produced.produced_tokens = self.produced_samples, self.produced_tokens
        produced.ledger = self.ledger
        produced.counters = dict(self.counters)
        return produced


@dataclass
class ProducerProgress:
    """What a checkpoint keeps of the producer besides the buffer."""

    model_step: int = 0  # the policy version the rollout serves
    consumer_step: int = 1  # the train step the next get_batch serves
    rounds: int = 0  # generation calls made, interrupted ones too; each round's new groups carry its number
    produced_groups: int = 0
    resumed_partial: int = 0  # samples continued after a pause (partial rollout)
    filtered_groups: int = 0  # dynamic sampling: scored groups whose rewards were all equal


class Producer:
    def __init__(
        self,
        config: TrellisConfig,
        *,
        sampler: PromptSampler[PromptRecord],
        rewards: RewardRunner,
        overlong: OverlongShaping | None = None,
        agent_loop: AgentLoop,
        record: Callable[[list[list[RolloutSample]], int], None],
        ledger: PromptLedger,
    ) -> None:
        """``record(groups, round, part)`` writes completed groups to the lake as they are produced;
        ``ledger`` says what the ledger records with each batch taken."""
        self._config = config
        self._sampler, self._rewards, self._agent_loop, self._record = sampler, rewards, agent_loop, record
        self._ledger = ledger
        self._resolved: list[dict] = []  # ledger rows of groups dropped since the previous batch was taken
        self._taken_batches: dict[int, TakenBatch] = {}  # the latest: a step that asks again gets the same groups
        self._overlong = overlong
        self._group_filter = GroupFilter.of(config.dynamic_sampling)
        self._backend: RolloutBackend | None = None  # given with each continue_produce
        buffer = config.replay_buffer
        self.buffer = ReplayBuffer(buffer.kind, config.stale_after, tail_trigger=buffer.tail_batch_trigger_size)
        self.progress = ProducerProgress()
        self._cond = threading.Condition()
        self._paused = True
        self._busy = False
        self._stopping = False
        self._failure: BaseException | None = None
        self._pause_s = 0.0
        self._window = [0.0, 0, 0]  # seconds, samples, tokens produced since the previous batch
        self._discarded: dict[str, int] = {}  # response tokens thrown away since the previous batch, by why (goodput)
        self._in_flight: list[list[RolloutSample]] = []  # groups of the round in progress not yet delivered
        self._trainer_waiting = False  # get_batch waits for groups
        self._part_size = max(1, config.train_batch_size // 4)  # groups per lake part otherwise
        self._thread: threading.Thread | None = None

    # -- the trainer's side -----------------------------------------------------------------------

    def continue_produce(self, model_step: int, backend: RolloutBackend) -> None:
        """Go on producing on ``backend``, which serves the weights of ``model_step``; after a failure,
        start again (the failed round's groups wait in the buffer)."""
        with self._cond:
            self.progress.model_step = model_step
            self._paused = False
            self._backend = backend
            backend.resume_generation()
            if self._failure is not None:
                self._failure, self._thread = None, None
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="trellis-producer", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pause_produce(self, timeout_s: float) -> float:
        """Stop producing (interrupting the generation in progress with partial rollout) and wait
        until the producer is idle; returns the seconds the pause took."""
        started = time.perf_counter()
        with self._cond:
            self._paused = True
            if self._config.replay_buffer.enable_partial_rollout and self._busy:
                self._backend.abort()
            if not self._cond.wait_for(lambda: not self._busy or self._failure is not None, timeout=timeout_s):
                raise TimeoutError(f"The producer did not pause within {timeout_s:g}s.")
            elapsed = time.perf_counter() - started
            self._pause_s += elapsed
            return elapsed

    def get_batch(self, step: int, timeout_s: float) -> TakenBatch | None:
        """``train_batch_size`` completed groups for ``step``, waiting up to ``timeout_s`` for them
        (None when they are not there yet); empty and ``expired`` when the producer waits for weights
        the trainer already has."""
        count = self._config.train_batch_size
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if step in self._taken_batches:  # a retried get_batch, or a driver that lost the first answer
                return self._taken_batches[step]
            self.progress.consumer_step = step
            self._cond.notify_all()
            while True:
                self._raise_failure()
                # Again after every wake-up: a group continued across weight syncs may arrive too stale.
                if self.buffer.refresh(step, self._expired):
                    self._cond.notify_all()
                if self.buffer.count("completed") >= count:
                    return self._take(step, count)
                if self._quota() <= 0 and step - 1 > self.progress.model_step:
                    return self._taken([], step, expired=True)
                if self._thread is None:
                    raise ProducerFailure(f"Step {step} asked for a batch before the producer was started (continue_produce).")
                self._trainer_waiting = True
                try:
                    woken = self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
                finally:
                    self._trainer_waiting = False
                if not woken and time.monotonic() >= deadline:
                    return None

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = self._paused = True
            if self._busy:
                self._backend.abort()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Only while paused: nothing is in flight then."""
        with self._cond:
            assert not self._busy, "pause the producer before saving it"
            keep = not self._config.checkpoint_no_save_replay_buffer
            return {
                "buffer": self.buffer.state_dict(keep_generations=keep), "progress": vars(self.progress).copy(),
                "ledger_resolved": list(self._resolved),
            }

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self.buffer.load_state_dict(state["buffer"])
            self.progress = ProducerProgress(**state["progress"])
            self._resolved = list(state.get("ledger_resolved", []))
            self._taken_batches.clear()

    # -- the producer's side ----------------------------------------------------------------------

    def _quota(self) -> int:
        progress = self.progress
        steps_ahead = progress.model_step + self._config.stale_after - progress.consumer_step + 1
        return self._config.train_batch_size * max(0, steps_ahead)

    def _room(self) -> int:
        return self._quota() - self.buffer.count("completed")

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._stopping or (not self._paused and self._room() > 0))
                    if self._stopping:
                        return
                    self._busy = True
                    groups, round_index = self._next_round(self._room())
                    self._in_flight = groups
                self._produce(groups, round_index)
        except BaseException as error:  # the trainer sees it at its next get_batch
            with self._cond:
                self._requeue_in_flight()  # drawn, not produced: generated again after a restart
                self._failure, self._busy = error, False
                self._cond.notify_all()

    def _next_round(self, size: int) -> tuple[list[list[RolloutSample]], int]:
        """Groups to generate on first (interrupted, expired, restored), then new prompts; ids carry
        the round, which no other round shares. A tail round (the tail lane is full) draws no new prompt."""
        progress = self.progress
        progress.rounds += 1
        groups = self.buffer.take_pending(size)
        progress.resumed_partial += sum(bool(s.response_ids) for group in groups for s in group)
        tail = self.buffer.take_tail(size - len(groups))
        fresh = [] if tail else new_groups(
            self._sampler.draw(size - len(groups)), repeat=self._config.prompt_repeat_k,
            version=progress.model_step, train_step=progress.rounds, id_prefix="train-r",
        )
        return groups + tail + fresh, progress.rounds

    def _produce(self, groups: list[list[RolloutSample]], round_index: int) -> None:
        """Generate a round; each group goes to the lake and then the buffer as soon as all its
        samples have ended (in parts, so the trainer need not wait for the round's longest response).
        Groups a pause interrupted go back to the buffer as pending."""
        started = time.perf_counter()
        unfinished = [s for group in groups for s in group if s.finish_reason in ("", "abort")]
        tokens_before = sum(len(s.response_ids) for s in unfinished)
        group_of = {id(s): group for group in groups for s in group}
        generating = {id(group): 0 for group in groups}
        for sample in unfinished:
            generating[id(group_of[id(sample)])] += 1
        ended = [group for group in groups if generating[id(group)] == 0]
        params = sampling_params(self._config.rollout, seed=step_seed(self._config.seed, round_index, salt=3))
        parts = 0
        for sample in self._agent_loop.stream(unfinished, self._backend, params):
            group = group_of[id(sample)]
            generating[id(group)] -= 1
            if generating[id(group)] == 0 and all(s.status != Status.ABORTED for s in group):
                ended.append(group)
            if ended and (len(ended) >= self._part_size or self._completes_a_waiting_batch(len(ended))):
                self._deliver(ended, round_index, parts)
                ended, parts = [], parts + 1
        if ended:
            self._deliver(ended, round_index, parts)
        with self._cond:
            self._window[0] += time.perf_counter() - started
            self._window[2] += sum(len(s.response_ids) for s in unfinished) - tokens_before
            self._requeue_in_flight()  # interrupted by a pause: continued in a later round

    def _requeue_in_flight(self) -> None:
        """Under the lock: the round's groups not delivered go back to the buffer, to be generated on."""
        for group in self._in_flight:
            self.buffer.put(group, "pending")
        self._in_flight = []

    def _completes_a_waiting_batch(self, ended: int) -> bool:
        """Whether ``ended`` more groups would let a waiting get_batch return (then they go now, not
        at the next full lake part)."""
        with self._cond:
            return self._trainer_waiting and self.buffer.count("completed") + ended >= self._config.train_batch_size

    def _deliver(self, groups: list[list[RolloutSample]], round_index: int, part: int) -> None:
        """Score whole groups, write them to the lake, then make them available to the trainer (with
        dynamic sampling, only those whose rewards differ: the producer goes on until the buffer is full)."""
        unscored = [s for group in groups for s in group if s.status == Status.COMPLETED and s.reward is None]
        score(unscored, self._rewards, self._overlong)
        trainable = filter_flat_groups(groups, self._group_filter, flat=self._config.dynamic_sampling.enable)
        self._record(groups, round_index, part)
        delivered = {id(group) for group in groups}
        with self._cond:
            self._in_flight = [group for group in self._in_flight if id(group) not in delivered]
            for group in trainable:
                self.buffer.put(group, "completed")
            kept = {id(group) for group in trainable}
            self._resolved += [self._ledger.row(group) for group in groups if id(group) not in kept]
            self.progress.produced_groups += len(groups)
            self.progress.filtered_groups += len(groups) - len(trainable)
            self._discard("filtered", [group for group in groups if id(group) not in kept])
            self._window[1] += sum(len(group) for group in groups)
            self._cond.notify_all()

    def _take(self, step: int, count: int) -> TakenBatch:
        groups = self.buffer.take(count)
        self.progress.consumer_step = step + 1  # what the producer may now run ahead of
        self._cond.notify_all()
        for sample in (s for group in groups for s in group):
            sample.train_step = step
            if self._config.replay_buffer.mask_offpolicy_in_partial_rollout and sample.response_versions:
                newest = max(sample.response_versions)
                sample.response_mask = [int(version == newest) for version in sample.response_versions]
        taken = self._taken(groups, step, expired=self._quota() <= 0)
        self._taken_batches = {step: taken}
        return taken

    def _expired(self, group: list[RolloutSample], given_up: bool) -> None:
        """The buffer expires ``group`` (before dropping its responses): generated again, or given up."""
        self._discard("given_up" if given_up else "expired", [group])
        self._resolved.append(self._ledger.row(group, "given_up" if given_up else "expired", f"older than {self._config.stale_after} steps"))

    def _discard(self, why: str, groups: list[list[RolloutSample]]) -> None:
        tokens = sum(len(sample.response_ids) for group in groups for sample in group)
        self._discarded[why] = self._discarded.get(why, 0) + tokens

    def _ledger_entries(self) -> LedgerEntries:
        """The rows of the groups dropped since the last batch, and every group still open: buffered,
        or in the round being generated. Under the lock: consistent with the samplers' positions."""
        resolved, self._resolved = self._resolved, []
        still_open = [group.samples for group in self.buffer.groups] + list(self._in_flight)
        return self._ledger.entries(resolved, still_open)

    def _taken(self, groups: list[list[RolloutSample]], step: int, *, expired: bool) -> TakenBatch:
        ages = [staleness(v, step) for group in groups for s in group for v in (s.response_versions or [s.policy_version])]
        counters = {
            "async/completed_groups": float(self.buffer.count("completed")),
            "async/pending_groups": float(self.buffer.count("pending")),
            "async/expired_groups": float(self.buffer.expired_total),
            "async/given_up_groups": float(len(self.buffer.given_up)),
            "async/tail_waiting_groups": float(self.buffer.count("tail")),
            "async/tail_rounds": float(self.buffer.tail_rounds),
            "async/tail_trained_groups": float(self.buffer.tail_trained),
            "async/resumed_partial_samples": float(self.progress.resumed_partial),
            "async/produced_groups": float(self.progress.produced_groups),
            "async/filtered_groups": float(self.progress.filtered_groups),
            "async/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "async/staleness_max": float(max(ages)) if ages else 0.0,
            "timing/pause_s": self._pause_s,
        }
        if groups:  # an empty batch trains no step: what was thrown away counts with the next one
            counters.update({f"async/discarded_tokens/{why}": float(self._discarded.get(why, 0)) for why in ("filtered", "expired", "given_up", "aborted")})
            self._discarded = {}
        pause_s, self._pause_s = self._pause_s, 0.0
        (seconds, samples, tokens), self._window = self._window, [0.0, 0, 0]
        ledger = self._ledger_entries() if groups else None  # an empty batch records nothing: the rows wait
        return TakenBatch(groups, expired, pause_s, counters, seconds, samples, tokens, ledger)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise ProducerFailure(f"The background producer failed: {type(self._failure).__name__}: {self._failure}") from self._failure
