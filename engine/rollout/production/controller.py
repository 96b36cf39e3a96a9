"""The rollout controller: owns the prompts, the sampler and the reward runner, and turns a rollout
backend into scored batches. Used in-process by ``LocalRun`` and as a Ray actor by the flow.

``produce_batch(step)`` is idempotent: the sampler state before each step is remembered, so a retried
step draws the same prompts with the same seed instead of skipping ahead, and the latest batches are
kept by step, so a rollout launched ahead of its step (``start_rollout``) is collected by the step's
``produce_batch`` from whichever process asks, and the step's later phases name their batch by step.

With ``trainer: disaggregated`` it also owns the background producer and its replay buffer
(``engine.rollout.production.producer``); produced groups land in the lake as they are scored. A
colocated run that over-samples drives the same buffer a step at a time
(``engine.rollout.production.over_sampling``).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from transformers import AutoTokenizer

from trellis.engine.algo.eval_metrics import evaluation_metrics
from trellis.engine.rollout.rewards.shaping import OverlongShaping
from trellis.engine.config import TrellisConfig
from trellis.engine.data.prepare import PreparedBatch, prepare_train_data
from trellis.engine.data.samples import RolloutSample
from trellis.engine.rng import capture_rng, restore_rng
from trellis.engine.rollout.backends.base import RolloutBackend
from trellis.engine.rollout.production.dynamic_sampling import fill_batch, filter_flat_groups
from trellis.engine.rollout.production.user_hooks import EvalMetric, GroupFilter
from trellis.engine.rollout.production.produce import (
    ProduceResult,
    rollout_groups,
    sampling_params,
    step_seed,
)
from trellis.engine.rollout.production.over_sampling import OverSampler
from trellis.engine.rollout.production.producer import Producer
from trellis.engine.rollout.production.prompt_ledger import PromptLedger
from trellis.engine.rollout.production.task_mix import rollout_inputs
from trellis.engine.storage.checkpoints import load_object, save_object
from trellis.engine.storage.store import Store
from trellis.engine.storage.lake import (
    SCHEMA,
    RowLineage,
    produced_uri,
    read_groups,
    summary,
    to_row,
    write_part,
    write_samples,
)
from trellis.engine.storage.lake_images import store_inline_images
from trellis.engine.storage.ledger import LedgerEntries
from trellis.engine.storage.lineage import policy_checkpoints, record_step

_KEPT_SNAPSHOTS = 4
_KEPT_BATCHES = 2


class Controller:
    def __init__(self, config: TrellisConfig) -> None:
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_source)
        inputs = rollout_inputs(config, self.tokenizer)  # one task's, or a multi-task mix's
        self.sampler, self.train_report, self.eval_prompts = inputs.sampler, inputs.train_report, inputs.eval_prompts
        self.rewards, self.agent_loop, self.eval_loop = inputs.rewards, inputs.train_loop, inputs.eval_loop
        self.overlong = OverlongShaping.of(config)
        self.group_filter, self.eval_metric = GroupFilter.of(config.dynamic_sampling), EvalMetric.of(config.eval_metric)
        self.ledger = PromptLedger(config, inputs.samplers)
        self._sampler_before_step: dict[int, dict[str, int]] = {}
        self._produced: dict[int, ProduceResult] = {}
        self.guard_state: dict[str, Any] = {}  # the stability guard's history (engine.run.guard), checkpointed with the rest
        self.producer: Producer | None = None  # the replay buffer's: in the background, or one step at a time
        if config.keeps_replay_buffer:
            self.producer = (OverSampler if config.over_samples else Producer)(
                config, sampler=self.sampler, rewards=self.rewards, overlong=self.overlong, record=self._record_produced,
                agent_loop=self.agent_loop, ledger=self.ledger,
            )

    @property
    def dataset_size(self) -> int:
        return len(self.sampler)

    @property
    def has_produced(self) -> bool:
        """Whether this controller has drawn training prompts since it was built or restored."""
        return bool(self._sampler_before_step)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def produce_batch(self, step: int, backend: RolloutBackend) -> ProduceResult:
        if step in self._produced:
            return self._produced[step]
        retried = step in self._sampler_before_step
        if not retried:
            self._sampler_before_step[step] = self.sampler.state_dict()
            for old in sorted(self._sampler_before_step)[:-_KEPT_SNAPSHOTS]:
                del self._sampler_before_step[old]
        if isinstance(self.producer, OverSampler):  # a retried step goes on from the buffer, not a rewound sampler
            produced = self.producer.produce_step(step, backend).as_produced()
            self.keep(step, produced)
            return produced
        if retried:
            self.sampler.load_state_dict(self._sampler_before_step[step])
        config = self.config

        def produce_round(round_index: int, prompts: int) -> ProduceResult:
            # Round 0 is the plain step's round; dynamic sampling's further rounds get their own seeds and ids.
            return rollout_groups(
                self.sampler.draw(prompts),
                repeat=config.prompt_repeat_k,
                backend=backend,
                rewards=self.rewards,
                params=sampling_params(config.rollout, seed=step_seed(config.seed, step, salt=100 + round_index if round_index else 0)),
                train_step=step,
                id_prefix=f"train-d{round_index}-" if round_index else "train-",
                overlong=self.overlong,
                agent_loop=self.agent_loop,
            )

        if config.dynamic_sampling.enable:
            produced = fill_batch(produce_round, config.train_batch_size, config.dynamic_sampling.max_rounds, self.group_filter)
        else:
            produced = produce_round(0, config.train_batch_size)
            filter_flat_groups(produced.groups, self.group_filter, flat=False)
        if not config.debug_rollout:  # debug_rollout trains nothing: its prompts are not accounted for
            produced.ledger = self.ledger.entries()  # every group drawn is in this batch: none stays open
        self.keep(step, produced)
        return produced

    def keep(self, step: int, produced: ProduceResult) -> None:
        """Hold ``step``'s batch (produced, loaded or taken from the replay buffer) for the phases that
        follow, which name it by step: the orchestrator never carries the samples back and forth."""
        self._produced[step] = produced
        for old in sorted(self._produced)[:-_KEPT_BATCHES]:
            del self._produced[old]

    def batch(self, step: int) -> ProduceResult:
        try:
            return self._produced[step]
        except KeyError:
            raise LookupError(
                f"The controller holds no batch of step {step} (it keeps the latest {_KEPT_BATCHES}: "
                f"{sorted(self._produced)}); a restarted controller lost them and its run resumes from a checkpoint."
            ) from None

    def load_batch(self, step: int) -> ProduceResult:
        """``debug_train``: the batch a past run produced at ``step``, read back from its Parquet lake."""
        assert self.config.debug_rollout_dir is not None  # the config requires it in debug_train
        return ProduceResult.of(read_groups(Store(self.config.debug_rollout_dir, self.config.storage_options), "train", step))

    def prepare_data(self, groups: list[list[RolloutSample]], step: int) -> PreparedBatch:
        config = self.config
        return prepare_train_data(
            groups, config.advantage, shuffle=not config.deterministic, seed=step_seed(config.seed, step, 2),
            mask_truncated=config.loss.mask_truncated,
        )

    def evaluate(self, step: int, backend: RolloutBackend) -> tuple[list[list[RolloutSample]], dict[str, float]]:
        rollout = self.config.rollout
        produced = rollout_groups(
            [(0, prompt) for prompt in self.eval_prompts],
            repeat=rollout.eval_samples_per_prompt,
            backend=backend,
            rewards=self.rewards,
            params=sampling_params(rollout, seed=step_seed(self.config.seed, step, salt=1), evaluation=True),
            train_step=step,
            id_prefix="eval-",
            agent_loop=self.eval_loop,
        )
        metrics = evaluation_metrics(produced.groups, k=rollout.eval_samples_per_prompt, threshold=self.config.eval_correct_threshold)
        if self.eval_metric is not None:
            metrics.update(self.eval_metric(produced.groups))
        return produced.groups, metrics

    def write_trajectories(
        self, groups: list[list[RolloutSample]], step: int, split: str, flow_run_id: str | None = None,
        ledger: LedgerEntries | None = None,
    ) -> tuple[str, dict[str, float]]:
        """A step's samples into the lake, with their lineage (``flow_run_id``: the orchestrator run
        writing them); for a produced training batch, its groups and ``ledger`` into the ledger too."""
        samples = [sample for group in groups for sample in group]
        config = self.config
        checkpoints = policy_checkpoints(config, [sample.policy_version for sample in samples])
        uri = write_samples(
            samples, root=Store(config.trajectory_root(split), config.storage_options), run=config.experiment_name, split=split,
            step=step, lineage=RowLineage(flow_run_id, checkpoints),
            routing=config.rollout.store_routed_experts,
        )
        record_step(config, split=split, step=step, partition=uri, flow_run_id=flow_run_id, checkpoints=checkpoints)
        if split == "train" and ledger is not None:
            self.ledger.write(groups, ledger, step)
        return uri, summary(samples)

    def _record_produced(self, groups: list[list[RolloutSample]], round_index: int, part: int) -> None:
        samples = [s for group in groups for s in group]
        stored = store_inline_images(samples, Store(self.config.run_uri, self.config.storage_options))
        table = pa.Table.from_pylist([to_row(s, self.config.experiment_name, stored_images=stored) for s in samples], schema=SCHEMA)
        write_part(table, Store(produced_uri(self.config.run_uri, round_index), self.config.storage_options), part=part)

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = {"sampler": self.sampler.state_dict(), "rng": capture_rng(), "guard": self.guard_state}
        if self.producer is not None:
            state["producer"] = self.producer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], *, load_dataset: bool = True) -> None:
        if load_dataset:
            self.sampler.load_state_dict(state["sampler"])
        self._sampler_before_step.clear()
        self._produced.clear()
        self.guard_state = dict(state.get("guard", {}))
        restore_rng(state["rng"])
        if self.producer is not None and "producer" in state:
            self.producer.load_state_dict(state["producer"])

    def save_checkpoint(self, uri: str) -> None:
        save_object(self.state_dict(), Store(uri, self.config.storage_options).join("controller.pt"))

    def load_checkpoint(self, uri: str, *, load_dataset: bool = True) -> None:
        if self.producer is not None:  # a live controller of a failed attempt may still be producing
            self.producer.pause_produce(self.config.cluster.ray_get_timeout_s)
        state = load_object(Store(uri, self.config.storage_options).join("controller.pt"))
        self.load_state_dict(state, load_dataset=load_dataset)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.shutdown()
        self.rewards.close()
        self.agent_loop.close()
