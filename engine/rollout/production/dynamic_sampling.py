"""DAPO's dynamic sampling: keep only groups whose rewards differ, and sample more prompts until the
batch is full.

Under a group baseline a group whose rewards are all equal gets zero advantage everywhere: it costs a
training pass and teaches nothing, and as the policy improves more groups end up all right. Such a
group is marked FILTERED (it stays in the lake, with the reason) and does not count towards the batch.
Each further round draws enough prompts for the groups still missing at the keep rate seen so far (at
most ``train_batch_size``); after ``max_rounds`` a batch still short trains on what it has. Groups kept
beyond ``train_batch_size`` are filtered as surplus.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.rollout.production.produce import ProduceResult
from trellis.engine.rollout.production.user_hooks import GroupFilter

logger = logging.getLogger(__name__)

Group = list[RolloutSample]


def is_scored(group: Group) -> bool:
    return all(s.status == Status.COMPLETED and s.reward is not None for s in group)


def has_reward_spread(group: Group) -> bool:
    return len({s.reward for s in group}) > 1


def filter_flat_groups(groups: list[Group], user_filter: GroupFilter | None = None, *, flat: bool = True) -> list[Group]:
    """Marks FILTERED every scored group whose rewards are all equal (with ``flat``) or that the user's
    filter drops; returns the others (failed ones included: data preparation drops those as before)."""
    kept = []
    for group in groups:
        if flat and is_scored(group) and not has_reward_spread(group):
            for sample in group:
                sample.filter_out(f"dynamic sampling: every reward of the group is {group[0].reward:g}")
        elif user_filter is not None and is_scored(group) and user_filter.drops(group):
            for sample in group:
                sample.filter_out(f"group_filter {user_filter.spec}")
        else:
            kept.append(group)
    return kept


def fill_batch(
    produce_round: Callable[[int, int], ProduceResult], target: int, max_rounds: int, user_filter: GroupFilter | None = None
) -> ProduceResult:
    """Up to ``max_rounds`` calls of ``produce_round(round, prompts)``, until ``target`` groups with a
    reward spread are in; the result holds every group produced, and ``sampling/*`` counters."""
    launched_s, started = time.time(), time.perf_counter()
    kept: list[Group] = []
    dropped: list[Group] = []  # filtered or failed
    seen = produced_samples = produced_tokens = filtered = rounds = 0
    count = target
    while rounds < max_rounds:
        result = produce_round(rounds, count)
        rounds += 1
        seen += len(result.groups)
        produced_samples += result.produced_samples
        produced_tokens += result.produced_tokens
        survivors = filter_flat_groups(result.groups, user_filter)
        filtered += len(result.groups) - len(survivors)
        kept += [group for group in survivors if is_scored(group)]
        dropped += [group for group in result.groups if not is_scored(group)]
        missing = target - len(kept)
        if missing <= 0:
            break
        count = min(target, math.ceil(missing * seen / len(kept))) if kept else target
    surplus = kept[target:]
    for group in surplus:
        for sample in group:
            sample.filter_out("dynamic sampling: surplus over train_batch_size")
    if len(kept) < target:
        logger.warning(
            "Dynamic sampling found %d of %d groups with differing rewards in %d rounds; the step trains on those.",
            len(kept), target, rounds,
        )
    outcome = ProduceResult.of(kept[:target] + surplus + dropped, produce_time_s=time.perf_counter() - started, launched_s=launched_s)
    outcome.produced_samples, outcome.produced_tokens = produced_samples, produced_tokens
    outcome.counters = {
        "sampling/rounds": float(rounds),
        "sampling/filtered_groups": float(filtered),
        "sampling/surplus_groups": float(len(surplus)),
        "sampling/kept_groups": float(min(len(kept), target)),
        "sampling/missing_groups": float(max(0, target - len(kept))),
    }
    return outcome
