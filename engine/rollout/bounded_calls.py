"""Calls of user code (reward functions) in worker processes, each bounded by a timeout, where a batch
with hung calls costs about one timeout of wall time, not one per hung call.

A plain pool of N processes runs a batch's calls N at a time, so each call that hangs holds a worker
until its timeout kills it, and the calls queued behind it wait: five hung calls on one worker cost
five timeouts. Here the calls are handed out only as workers free up; when every worker is held by a
call that has run past ``straggler_s``, another pool of N workers joins (up to ``max_pools``) and the
queue goes on there while the slow calls run out their time. The extra pools end with the batch.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pebble import ProcessPool

_POLL_S = 0.05


@dataclass
class _Running:
    index: int
    pool: ProcessPool
    started_s: float


class BoundedCalls:
    def __init__(self, num_workers: int, timeout_s: float, *, straggler_s: float | None = None, max_pools: int = 8) -> None:
        self.num_workers, self.timeout_s, self.max_pools = num_workers, timeout_s, max_pools
        # A call this slow is treated as stuck for the purpose of opening another pool (it still gets
        # its full timeout). Each hung call delays the next by this much, so it is short; a slow but
        # healthy function only gets more workers for the rest of its batch.
        self.straggler_s = straggler_s if straggler_s is not None else min(0.1, timeout_s / 10)
        self._pool = self._new_pool()
        self.extra_pools_opened = 0  # over this object's life: how often hung calls were worked around

    def _new_pool(self) -> ProcessPool:
        # fork, not spawn: spawn re-runs the user's __main__ script in every worker, which breaks any
        # script without an `if __name__ == "__main__"` guard.
        return ProcessPool(max_workers=self.num_workers, context=multiprocessing.get_context("fork"))

    def map(self, function: Callable[..., Any], arguments: Sequence[tuple]) -> list[Future]:
        """One finished future per argument tuple, in order: a result, the call's exception, or
        ``concurrent.futures.TimeoutError`` for a call that ran past the timeout."""
        queue = deque(range(len(arguments)))
        futures: list[Future | None] = [None] * len(arguments)
        running: dict[Future, _Running] = {}
        pools = [self._pool]
        try:
            while queue or running:
                now = time.monotonic()
                free = {id(pool): self.num_workers for pool in pools}
                for call in running.values():
                    free[id(call.pool)] -= 1
                if queue and not any(free.values()) and len(pools) < self.max_pools:
                    if all(now - call.started_s > self.straggler_s for call in running.values()):
                        pools.append(self._new_pool())
                        self.extra_pools_opened += 1
                        free[id(pools[-1])] = self.num_workers
                for pool in pools:
                    while queue and free[id(pool)] > 0:
                        index = queue.popleft()
                        future = pool.schedule(function, args=arguments[index], timeout=self.timeout_s)
                        futures[index] = future
                        running[future] = _Running(index, pool, time.monotonic())
                        free[id(pool)] -= 1
                if running:
                    done, _ = wait(list(running), timeout=_POLL_S, return_when=FIRST_COMPLETED)
                    for future in done:
                        del running[future]
        finally:
            for pool in pools[1:]:
                pool.stop()
                pool.join(timeout=5)
        return futures  # type: ignore[return-value]

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=5)
