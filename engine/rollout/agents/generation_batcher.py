"""Generation requests from many threads, served in batches: a request waits until no other has arrived
for ``window_s`` (at most 20 windows), then all waiting ones go to the backend in one ``generate``
call, as the agent loops' own turns do. Agents that call the model one at a time therefore still fill
the backend's batch."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from concurrent.futures import Future
from typing import Iterator

from trellis.engine.rollout.backends.base import Generation, RolloutBackend, SamplingParams

_STOP = object()


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    limit: int
    future: Future


class GenerationBatcher:
    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._queue: queue.Queue = queue.Queue()
        self._backend: RolloutBackend | None = None
        self._params: SamplingParams | None = None
        self._calls = 0
        self.batch_sizes: list[int] = []
        self._thread = threading.Thread(target=self._loop, name="generation-batcher", daemon=True)
        self._thread.start()

    @property
    def policy_version(self) -> int:
        return self._backend.policy_version if self._backend is not None else 0

    @contextlib.contextmanager
    def serving(self, backend: RolloutBackend, params: SamplingParams) -> Iterator[None]:
        """Requests are served with this backend and these sampling settings while inside."""
        self._backend, self._params, self.batch_sizes = backend, params, []
        try:
            yield
        finally:
            self._backend = self._params = None

    def submit(self, prompt_ids: list[int], limit: int) -> Future:
        future: Future = Future()
        self._queue.put(_Request(list(prompt_ids), max(1, limit), future))
        return future

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch, stop = self._gather(first)
            self._generate(batch)
            if stop:
                return

    def _gather(self, first: _Request) -> tuple[list[_Request], bool]:
        batch, deadline = [first], time.monotonic() + 20 * self._window_s
        while time.monotonic() < deadline:
            try:
                request = self._queue.get(timeout=self._window_s)
            except queue.Empty:
                break
            if request is _STOP:
                return batch, True
            batch.append(request)
        return batch, False

    def _generate(self, batch: list[_Request]) -> None:
        backend, params = self._backend, self._params
        if backend is None or params is None:
            for request in batch:
                request.future.set_exception(RuntimeError("the rollout gateway is not serving a batch right now"))
            return
        limits = [request.limit for request in batch]
        seed = None if params.seed is None else params.seed + self._calls
        self._calls += 1
        self.batch_sizes.append(len(batch))
        try:
            generations: list[Generation] = backend.generate(
                [request.prompt_ids for request in batch], dataclasses.replace(params, max_new_tokens=max(limits), seed=seed), limits
            )
        except Exception as error:  # the callers' sessions see it as a failed call
            for request in batch:
                request.future.set_exception(error)
            return
        for request, generation in zip(batch, generations):
            request.future.set_result(generation)
