"""A stateful prompt sampler: seeded shuffles per epoch, exact resume from ``state_dict``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

import torch

T = TypeVar("T")


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # index into this epoch's permutation
    consumed: int = 0  # prompts handed out since the start of the run


class PromptSampler(Generic[T]):
    """Hands out prompts epoch after epoch; each epoch is a permutation drawn from ``seed + epoch``.

    The permutation is a pure function of (seed, epoch, dataset size), so the state is three integers
    and resuming replays exactly the order an uninterrupted run would have seen.
    """

    def __init__(self, items: Sequence[T], *, seed: int, shuffle: bool = True) -> None:
        if not items:
            raise ValueError("PromptSampler needs at least one item.")
        self._items = items
        self._seed = seed
        self._shuffle = shuffle
        self._state = SamplerState()
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def epoch(self) -> int:
        return self._state.epoch

    def sample(self, count: int) -> list[T]:
        return [item for _, item in self.draw(count)]

    def draw(self, count: int) -> list[tuple[int, T]]:
        """The next ``count`` items, each with the epoch it was drawn in."""
        batch: list[tuple[int, T]] = []
        while len(batch) < count:
            if self._state.position == len(self._order):
                self._state.epoch += 1
                self._state.position = 0
                self._order = self._permutation(self._state.epoch)
            take = min(count - len(batch), len(self._order) - self._state.position)
            indices = self._order[self._state.position : self._state.position + take]
            batch.extend((self._state.epoch, self._items[i]) for i in indices)
            self._state.position += take
            self._state.consumed += take
        return batch

    @property
    def drawn(self) -> tuple[int, int]:
        """(epoch, position): every item of the epochs before ``epoch`` has been handed out, and the
        first ``position`` of ``epoch_order(epoch)``."""
        return self._state.epoch, self._state.position

    def epoch_order(self, epoch: int) -> list[T]:
        """The items of ``epoch`` in the order they are handed out."""
        return [self._items[i] for i in self._permutation(epoch)]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self._state.epoch,
            "position": self._state.position,
            "consumed": self._state.consumed,
            "seed": self._seed,
            "size": len(self._items),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["size"] != len(self._items) or state["seed"] != self._seed:
            raise ValueError(
                f"Sampler state was saved for {state['size']} prompts with seed {state['seed']}, but this "
                f"dataset has {len(self._items)} prompts and seed {self._seed}: the data order cannot be resumed."
            )
        self._state = SamplerState(state["epoch"], state["position"], state["consumed"])
        self._order = self._permutation(self._state.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        if not self._shuffle:
            return list(range(len(self._items)))
        generator = torch.Generator().manual_seed(self._seed + epoch)
        return torch.randperm(len(self._items), generator=generator).tolist()
