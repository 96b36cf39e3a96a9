"""Colocated over-sampling (XTuner's ``over_sample_threshold``, with its partial rollout and token
staleness): the long tail of response lengths cut without a second device pool.

Each step launches ``train_batch_size x (1 + over_sample_threshold)`` groups on the colocated engines
and stops generating once ``train_batch_size`` of them have ended; those are trained. What the stop
leaves is kept in the producer's replay buffer for the next step:

- groups that ended beyond the batch (scored, as ``completed``): trained first next step;
- groups still generating (``pending``): with ``enable_partial_rollout`` continued next step with the new
  weights (each token records its policy version), else started again from their prompt, their tokens
  counted as thrown away (``async/discarded_tokens/aborted``).

A buffered group whose oldest token is ``stale_after`` steps old when a step begins expires as in the
disaggregated trainer (generated again, given up, or into the tail lane): ``max_staleness`` is XTuner's
token staleness threshold. The rounds run on the caller's thread, one step at a time: the engines are
free for training once ``produce_step`` returns, and the buffer is checkpointed with the controller.
"""

from __future__ import annotations

import dataclasses
import math

from trellis.engine.data.samples import RolloutSample
from trellis.engine.rollout.backends.base import RolloutBackend
from trellis.engine.rollout.production.producer import Producer, TakenBatch
from trellis.engine.rollout.production.replay_buffer import reset_responses


class OverSampler(Producer):
    """The producer's buffer, rounds and ledger, driven a step at a time instead of in the background."""

    _stop_at: int = 0  # while a round runs: the completed groups at which generation stops

    def produce_step(self, step: int, backend: RolloutBackend) -> TakenBatch:
        """``train_batch_size`` groups for ``step`` (fewer only where filters left a batch short), made
        with the weights ``backend`` serves; a step asked again gets the same groups."""
        count = self._config.train_batch_size
        buffer = self._config.replay_buffer
        launch = math.ceil(count * (1 + buffer.over_sample_threshold))
        rounds = self._config.dynamic_sampling.max_rounds if self._config.dynamic_sampling.enable else 1
        with self._cond:
            if step in self._taken_batches:
                return self._taken_batches[step]
            self.progress.model_step, self.progress.consumer_step = backend.policy_version, step
            self._backend = backend
            self.buffer.refresh(step, self._expired)
        for _ in range(rounds):
            completed = self.buffer.count("completed")
            if completed >= count:
                break
            self._run_round(launch - completed, stop_at=count)
        with self._cond:
            taken = self._take(step, count)
            # Not the disaggregated quota's "sync first": a colocated step always trains what it took.
            taken = dataclasses.replace(taken, expired=False)
            self._taken_batches = {step: taken}
            return taken

    def _run_round(self, size: int, *, stop_at: int) -> None:
        with self._cond:
            self._busy, self._stop_at = True, stop_at
            groups, round_index = self._next_round(size)
            self._in_flight = groups
        self._backend.resume_generation()
        try:
            self._produce(groups, round_index)
        except BaseException:
            with self._cond:  # drawn, not trained: a retried step generates them first
                self._requeue_in_flight()
            raise
        finally:
            self._backend.resume_generation()  # stopped at the full batch: the engines serve the next caller
            with self._cond:
                self._busy, self._stop_at = False, 0
                if not self._config.replay_buffer.enable_partial_rollout:
                    self._restart_interrupted()

    def _restart_interrupted(self) -> None:
        """Without partial rollout, a group the stop interrupted starts again from its prompt."""
        interrupted = [g for g in self.buffer.groups if g.status == "pending" and any(s.response_ids for s in g.samples)]
        self._discard("aborted", [g.samples for g in interrupted])
        for group in interrupted:
            reset_responses(group.samples)

    def _completes_a_waiting_batch(self, ended: int) -> bool:
        """The group that fills the batch is delivered at once (and the round stopped), not with the
        next full lake part."""
        with self._cond:
            return self.buffer.count("completed") + ended >= self._stop_at

    def _deliver(self, groups: list[list[RolloutSample]], round_index: int, part: int) -> None:
        super()._deliver(groups, round_index, part)
        if self.buffer.count("completed") >= self._stop_at:
            self._backend.abort()  # the rest of the round ends now, with what it has
