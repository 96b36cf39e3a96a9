"""Several rollout engines behind the one rollout contract, so the controller and the producer run
unchanged on one engine or many.

Each call spreads its prompts over the engines by load: the samples of one group (consecutive,
identical prompts) stay on one engine, where they share the prompt's KV cache, and the largest groups
go first, each to the engine with the fewest tokens to go so far. Engines run in threads of their own;
``stream`` hands on each sample as soon as any engine finishes it.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

import torch

from trellis.engine.rollout.backends.base import Generation, RolloutBackend, SamplingParams

T = TypeVar("T")
_DONE = object()


def spread_by_load(prompts: Sequence[Sequence[int]], limits: Sequence[int], engines: int) -> list[list[int]]:
    """Prompt indices for each engine; a group's samples together, the largest groups placed first."""
    groups: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        if groups and list(prompts[groups[-1][0]]) == list(prompt):
            groups[-1].append(index)
        else:
            groups.append([index])
    cost = [len(prompt) + limit for prompt, limit in zip(prompts, limits)]
    shares: list[list[int]] = [[] for _ in range(engines)]
    loads = [0] * engines
    for group in sorted(groups, key=lambda g: -sum(cost[i] for i in g)):
        target = loads.index(min(loads))
        shares[target].extend(group)
        loads[target] += sum(cost[i] for i in group)
    return [sorted(share) for share in shares]


class RolloutPool:
    def __init__(self, engines: Sequence[RolloutBackend]) -> None:
        if not engines:
            raise ValueError("A rollout pool needs at least one engine.")
        self.engines = list(engines)

    @property
    def policy_version(self) -> int:
        """The oldest weights any engine serves (after a sync, all serve the same)."""
        return min(engine.policy_version for engine in self.engines)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> list[Generation]:
        limits = list(limits) if limits is not None else [params.max_new_tokens] * len(prompts)
        shares = spread_by_load(prompts, limits, len(self.engines))
        calls = [
            (lambda engine=engine, share=share: engine.generate([prompts[i] for i in share], params, [limits[i] for i in share]))
            for engine, share in zip(self.engines, shares)
            if share
        ]
        results = self._each(calls)
        generations: list[Generation | None] = [None] * len(prompts)
        for share, result in zip([s for s in shares if s], results):
            for index, generation in zip(share, result):
                generations[index] = generation
        return generations  # type: ignore[return-value]

    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> Iterator[tuple[int, Generation]]:
        limits = list(limits) if limits is not None else [params.max_new_tokens] * len(prompts)
        shares = [(engine, share) for engine, share in zip(self.engines, spread_by_load(prompts, limits, len(self.engines))) if share]
        finished: queue.Queue = queue.Queue()

        def run(engine: RolloutBackend, share: list[int]) -> None:
            try:
                for local, generation in engine.stream([prompts[i] for i in share], params, [limits[i] for i in share]):
                    finished.put((share[local], generation))
                finished.put(_DONE)
            except BaseException as error:  # handed to the consumer, which raises it
                finished.put(error)

        for engine, share in shares:
            threading.Thread(target=run, args=(engine, share), daemon=True, name="rollout-pool-stream").start()
        running = len(shares)
        while running:
            item = finished.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        self._each([lambda engine=engine: engine.load_weights(state_dict, policy_version) for engine in self.engines])

    def offload(self) -> None:
        self._each([engine.offload for engine in self.engines])

    def onload(self) -> None:
        self._each([engine.onload for engine in self.engines])

    def abort(self) -> None:
        self._each([engine.abort for engine in self.engines])

    def resume_generation(self) -> None:
        self._each([engine.resume_generation for engine in self.engines])

    def _each(self, calls: list[Callable[[], T]]) -> list[T]:
        """Run the calls on all engines at once; the first failure is raised after all have ended.
        Threads of their own per call: an ``abort`` must not queue behind the ``generate`` it stops."""
        with ThreadPoolExecutor(max_workers=max(1, len(calls)), thread_name_prefix="rollout-pool") as threads:
            futures = [threads.submit(call) for call in calls]
            return [future.result() for future in futures]
