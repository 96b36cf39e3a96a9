"""The rollout side's hand in the per-prompt ledger (``engine.storage.ledger``): which sampler a group
was drawn from, how far the samplers have drawn, and each epoch's prompts written once."""

from __future__ import annotations

from typing import Any, Iterable

from trellis.engine.config import TrellisConfig
from trellis.engine.data.prepare import group_outcome
from trellis.engine.data.prompts import PromptRecord
from trellis.engine.data.sampler import PromptSampler
from trellis.engine.data.samples import RolloutSample
from trellis.engine.storage.ledger import (
    SINGLE_TASK,
    Drawn,
    LedgerEntries,
    group_row,
    open_entry,
    read_universe,
    write_step,
    write_universe,
    written_epochs,
)
from trellis.engine.storage.store import Store

Group = list[RolloutSample]


class PromptLedger:
    def __init__(self, config: TrellisConfig, samplers: dict[str, PromptSampler[PromptRecord]]) -> None:
        self._config, self._samplers = config, samplers
        self._universe_written: dict[str, set[int]] | None = None  # read from the store on first write

    def sampler_of(self, group: Group) -> str:
        """A multi-task run's samples carry their task's name; a one-task run has one sampler."""
        return group[0].task_name if self._config.tasks else SINGLE_TASK

    def row(self, group: Group, status: str | None = None, reason: str = "") -> dict[str, Any]:
        """The group's row: ``status`` as given, else what training makes of the group."""
        if status is None:
            status, reason = group_outcome(group)
        return group_row(group, self.sampler_of(group), status, reason)

    def entries(self, resolved: Iterable[dict[str, Any]] = (), still_open: Iterable[Group] = ()) -> LedgerEntries:
        """The ledger's view now: how far each sampler has drawn, and the groups drawn and not resolved."""
        drawn = [Drawn(name, *sampler.drawn) for name, sampler in self._samplers.items()]
        return LedgerEntries(list(resolved), drawn, [open_entry(group, self.sampler_of(group)) for group in still_open])

    def write(self, groups: list[Group], entries: LedgerEntries, step: int) -> None:
        """A training step's part: the batch's groups as training takes them, and ``entries``."""
        config = self._config
        self._write_universes(entries.drawn)
        write_step(
            [self.row(group) for group in groups], entries, store=Store(config.run_uri, config.storage_options),
            run=config.experiment_name, step=step,
        )

    def _write_universes(self, drawn: list[Drawn]) -> None:
        """Each epoch a sampler has begun, in its draw order, unless already written."""
        config = self._config
        if self._universe_written is None:
            self._universe_written = {name: self._current_universes(name) for name in self._samplers}
        for frontier in drawn:
            written = self._universe_written[frontier.sampler]
            for epoch in range(frontier.epoch + 1):
                if epoch not in written:
                    order = self._samplers[frontier.sampler].epoch_order(epoch)
                    write_universe(
                        [prompt.index for prompt in order], store=Store(config.run_uri, config.storage_options),
                        run=config.experiment_name, sampler=frontier.sampler, epoch=epoch,
                    )
                    written.add(epoch)

    def _current_universes(self, sampler: str) -> set[int]:
        """The epochs whose stored universe this sampler would write alike (one read: an epoch's order
        follows from the seed and the dataset, so a match at epoch 0 holds for all)."""
        config = self._config
        stored = written_epochs(Store(config.run_uri, config.storage_options), sampler)
        if 0 not in stored:
            return set()
        first = read_universe(Store(config.run_uri, config.storage_options), sampler, 0)
        return stored if first == [prompt.index for prompt in self._samplers[sampler].epoch_order(0)] else set()
