"""What the rollout side draws prompts from and makes samples with, for one task or several.

A one-task run has one prompt sampler, one reward runner and one agent loop. A multi-task run
(``tasks:``) gets the same three behind the same interfaces: a sampler that splits each draw by the
tasks' weights (``task_mix: exact``: every batch by weight, each remainder to the tasks furthest behind
their share of all draws so far; ``random``: each group's task drawn with probability weight / total,
seeded per draw, so a retried or resumed step draws the same mix), a
reward runner that sends each sample to its task's, and an agent loop that runs each task's samples
through its own loop and sampling settings, one task after the other. Every sample carries its task's
name as ``task_name``, which the per-task metrics (``response/{task}/...``, ``eval/{task}/...``) read.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from trellis.engine.config import TaskConfig, TrellisConfig
from trellis.engine.data.prompts import PromptRecord, SkipReport, load_prompts
from trellis.engine.vision.processor import VisionProcessor
from trellis.engine.data.sampler import PromptSampler
from trellis.engine.data.samples import RolloutSample
from trellis.engine.rollout.agents.agent_loops import build_agent_loop
from trellis.engine.rollout.agents.base import AgentLoop
from trellis.engine.rollout.backends.base import RolloutBackend, SamplingParams
from trellis.engine.rollout.rewards.runner import RewardResult, RewardRunner
from trellis.engine.storage.ledger import SINGLE_TASK


@dataclass
class RolloutInputs:
    sampler: Any  # PromptSampler or MixedSampler: draw, state_dict, load_state_dict, len
    train_report: Any  # SkipReport or TaskReports: summary()
    eval_prompts: list[PromptRecord]
    rewards: Any  # RewardRunner or TaskRewards: score, close
    train_loop: AgentLoop
    eval_loop: AgentLoop
    samplers: dict[str, PromptSampler[PromptRecord]]  # the ledger's view: each task's own sampler, by name


def rollout_inputs(config: TrellisConfig, tokenizer: Any) -> RolloutInputs:
    vision = VisionProcessor.of_model(config.load_from)  # None for a text-only policy
    if not config.tasks:
        assert config.train_dataset is not None  # the config requires one or the other
        prompts, report = load_prompts(config.train_dataset, tokenizer, vision)
        eval_prompts = load_prompts(config.eval_dataset, tokenizer, vision)[0] if config.eval_dataset is not None else []
        loop = build_agent_loop(config.agent, tokenizer, config.max_prompt_length)
        sampler = PromptSampler(prompts, seed=config.seed)
        return RolloutInputs(
            sampler, report, eval_prompts, RewardRunner(config.reward), loop, loop, samplers={SINGLE_TASK: sampler}
        )
    tasks = [_build_task(task, config, tokenizer, vision) for task in config.tasks]
    return RolloutInputs(
        sampler=MixedSampler(tasks, seed=config.seed, mix=config.task_mix),
        train_report=TaskReports({task.name: task.report for task in tasks}),
        eval_prompts=[prompt for task in tasks for prompt in task.eval_prompts],
        rewards=TaskRewards(tasks),
        train_loop=TaskLoops(tasks, evaluation=False),
        eval_loop=TaskLoops(tasks, evaluation=True),
        samplers={task.name: task.sampler for task in tasks},
    )


@dataclass
class _Task:
    config: TaskConfig
    sampler: PromptSampler[PromptRecord]
    report: SkipReport
    eval_prompts: list[PromptRecord]
    rewards: RewardRunner
    loop: AgentLoop

    @property
    def name(self) -> str:
        return self.config.name


def _build_task(task: TaskConfig, config: TrellisConfig, tokenizer: Any, vision: VisionProcessor | None) -> _Task:
    prompts, report = load_prompts(task.train_dataset, tokenizer, vision)
    eval_prompts = load_prompts(task.eval_dataset, tokenizer, vision)[0] if task.eval_dataset is not None else []
    if not prompts:
        raise ValueError(f"tasks[{task.name}]: no usable prompt in {task.train_dataset.source} ({report.summary()}).")
    return _Task(
        config=task,
        sampler=PromptSampler([_of_task(p, task) for p in prompts], seed=config.seed),
        report=report,
        eval_prompts=[_of_task(p, task) for p in eval_prompts],
        rewards=RewardRunner(task.reward or config.reward),
        loop=build_agent_loop(task.agent or config.agent, tokenizer, config.max_prompt_length),
    )


def _of_task(record: PromptRecord, task: TaskConfig) -> PromptRecord:
    caps = [cap for cap in (record.max_new_tokens, task.max_new_tokens) if cap is not None]
    return dataclasses.replace(record, task_name=task.name, max_new_tokens=min(caps) if caps else None)


class TaskReports:
    def __init__(self, reports: dict[str, SkipReport]) -> None:
        self.reports = reports

    def summary(self) -> str:
        return "; ".join(f"{name}: {report.summary()}" for name, report in self.reports.items())


class MixedSampler:
    def __init__(self, tasks: list[_Task], *, seed: int, mix: str = "exact") -> None:
        self._tasks, self._seed, self._draws, self._mix = tasks, seed, 0, mix
        self._weights = torch.tensor([task.config.weight for task in tasks], dtype=torch.float64)
        self._assigned = [0] * len(tasks)  # groups given to each task so far (exact mix)

    def __len__(self) -> int:
        return sum(len(task.sampler) for task in self._tasks)

    def draw(self, count: int) -> list[tuple[int, PromptRecord]]:
        picks = self._exact(count) if self._mix == "exact" else self._random(count)
        self._draws += 1
        return [item for index, task in enumerate(self._tasks) for item in task.sampler.draw(picks[index])]

    def _random(self, count: int) -> Counter:
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + self._draws)
        return Counter(torch.multinomial(self._weights, count, replacement=True, generator=generator).tolist())

    def _exact(self, count: int) -> Counter:
        """Each group to the task furthest behind its share of every group drawn so far (the first on a tie):
        a batch splits by weight to within one group, and small draws add up to the weights."""
        shares = (self._weights / self._weights.sum()).tolist()
        picks: Counter = Counter()
        for _ in range(count):
            total = sum(self._assigned) + 1
            index = max(range(len(shares)), key=lambda i: (shares[i] * total - self._assigned[i], -i))
            self._assigned[index] += 1
            picks[index] += 1
        return picks

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self._draws, "assigned": list(self._assigned),
                "tasks": {task.name: task.sampler.state_dict() for task in self._tasks}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [task.name for task in self._tasks if task.name not in state.get("tasks", {})]
        if missing:
            raise ValueError(f"The checkpoint's sampler state has no task {missing}: was it saved by a run with other tasks?")
        self._draws = state["draws"]
        self._assigned = list(state.get("assigned", [0] * len(self._tasks)))
        for task in self._tasks:
            task.sampler.load_state_dict(state["tasks"][task.name])


class TaskRewards:
    def __init__(self, tasks: list[_Task]) -> None:
        self._runners = {task.name: task.rewards for task in tasks}

    def score(self, samples: list[dict[str, Any]]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(samples)
        for name, runner in self._runners.items():
            mine = [i for i, sample in enumerate(samples) if sample["task_name"] == name]
            for index, result in zip(mine, runner.score([samples[i] for i in mine]) if mine else []):
                results[index] = result
        return [result or RewardResult(None, {}, f"no task named {samples[i]['task_name']!r}") for i, result in enumerate(results)]

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()


class TaskLoops:
    """Each task's samples through its own agent loop; training rollouts with its own sampling settings."""

    def __init__(self, tasks: list[_Task], *, evaluation: bool) -> None:
        self._tasks, self._evaluation = tasks, evaluation

    def run(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> None:
        for _ in self.stream(samples, backend, params):
            pass

    def stream(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> Iterator[RolloutSample]:
        for task in self._tasks:
            mine = [sample for sample in samples if sample.task_name == task.name]
            if mine:
                yield from task.loop.stream(mine, backend, self._params(task.config, params))

    def _params(self, task: TaskConfig, params: SamplingParams) -> SamplingParams:
        if self._evaluation:
            return params
        changes = {"temperature": task.temperature, "top_p": task.top_p, "top_k": task.top_k}
        return dataclasses.replace(params, **{key: value for key, value in changes.items() if value is not None})

    def close(self) -> None:
        if not self._evaluation:  # the evaluation view shares the training view's loops
            for task in self._tasks:
                task.loop.close()
