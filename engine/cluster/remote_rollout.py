"""The rollout contract over a rollout worker's actor handle, so the controller's code (produce, the
producer, the rollout pool) runs unchanged whether its backend lives in its process or in an actor."""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import ray
import torch

from trellis.engine.rollout.backends.base import Generation, SamplingParams


class RemoteRollout:
    """The rollout contract over a rollout actor, so the controller's code runs unchanged."""

    def __init__(self, handle, timeout_s: float) -> None:
        self._handle = handle
        self._timeout_s = timeout_s
        self._version = ray.get(handle.policy_version.remote(), timeout=timeout_s)

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> list[Generation]:
        return ray.get(self._handle.generate.remote(prompts, params, limits), timeout=self._timeout_s)

    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> Iterator[tuple[int, Generation]]:
        items = self._handle.stream.remote(prompts, params, limits)
        while True:
            if not ray.wait([items], timeout=self._timeout_s)[0]:
                raise TimeoutError(f"The rollout worker made no sample in {self._timeout_s:g}s.")
            try:
                item = next(items)
            except StopIteration:
                return
            yield ray.get(item, timeout=self._timeout_s)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        ray.get(self._handle.load_weights.remote(state_dict, policy_version), timeout=self._timeout_s)

    def offload(self) -> None:
        ray.get(self._handle.offload.remote(), timeout=self._timeout_s)

    def onload(self) -> None:
        ray.get(self._handle.onload.remote(), timeout=self._timeout_s)

    def abort(self) -> None:
        ray.get(self._handle.abort.remote(), timeout=self._timeout_s)

    def resume_generation(self) -> None:
        ray.get(self._handle.resume_generation.remote(), timeout=self._timeout_s)
