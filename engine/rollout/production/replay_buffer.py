"""The disaggregated trainer's replay buffer: scored groups waiting for a training step.

Staleness of a sample trained at step t is ``t - v - 1``, v the policy version of its oldest token: a
sample made by the weights of step t-1 has staleness 0. A group whose staleness reaches
``stale_after`` (``(max_staleness + 1) x sync_weights_interval``) expires: its responses are dropped
and its prompt is generated again at once (``tail_trigger`` 0), given up (-1), or waits in the tail lane
(N > 0) until N expired groups have gathered; they are then generated together in a round of their own
(``take_tail``) and trained before any other group (XTuner's tail batch). Groups are never split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.storage.lake import from_row, to_row

# pending: to be generated on (interrupted, expired or restored); tail: expired, waiting in the tail lane
GroupStatus = Literal["completed", "pending", "tail"]


def staleness(version: int, step: int) -> int:
    return step - version - 1


def reset_responses(samples: list[RolloutSample]) -> None:
    """Back to the prompt: what a regenerated group starts from."""
    for sample in samples:
        sample.response_ids, sample.logprobs, sample.response_versions = [], [], []
        sample.routed_experts = None
        sample.response, sample.finish_reason, sample.response_mask = "", "", None
        sample.status, sample.error, sample.reward, sample.reward_payload = Status.COMPLETED, None, None, {}


@dataclass
class BufferedGroup:
    samples: list[RolloutSample]
    uid: int  # insertion order
    status: GroupStatus

    @property
    def oldest_version(self) -> int:
        return min(sample.oldest_version for sample in self.samples)

    def staleness(self, step: int) -> int:
        return staleness(self.oldest_version, step)


@dataclass
class ReplayBuffer:
    kind: Literal["sync", "async"]  # which completed groups are taken first: the oldest, or the stalest
    stale_after: int
    tail_trigger: int  # expired groups: 0 generated again at once, -1 given up, N > 0 wait in the tail lane for N
    groups: list[BufferedGroup] = field(default_factory=list)
    next_uid: int = 0
    expired_total: int = 0  # groups that ever expired
    given_up: list[tuple[int, int]] = field(default_factory=list)  # (epoch, prompt_index) of dropped groups
    tail_groups: set[str] = field(default_factory=set)  # group ids generated in a tail round, not trained yet
    tail_rounds: int = 0
    tail_trained: int = 0  # tail-lane groups ever trained

    def put(self, samples: list[RolloutSample], status: GroupStatus) -> None:
        self.groups.append(BufferedGroup(samples, self.next_uid, status))
        self.next_uid += 1

    def count(self, status: GroupStatus) -> int:
        return sum(group.status == status for group in self.groups)

    def refresh(self, step: int, on_expired: Callable[[list[RolloutSample], bool], None] | None = None) -> int:
        """Expire the groups too stale to train at ``step``; returns how many expired now.
        ``on_expired(samples, given_up)`` sees each one before its responses are dropped."""
        holding_tokens = [g for g in self.groups if any(s.response_ids for s in g.samples)]
        expired = [g for g in holding_tokens if g.staleness(step) >= self.stale_after]
        for group in expired:
            self.expired_total += 1
            if on_expired is not None:
                on_expired(group.samples, self.tail_trigger < 0)
            self.tail_groups.discard(group.samples[0].group_id)
            if self.tail_trigger >= 0:
                reset_responses(group.samples)
                group.status = "tail" if self.tail_trigger > 0 else "pending"
            else:
                self.groups.remove(group)
                self.given_up.append((group.samples[0].epoch, group.samples[0].prompt_index))
        return len(expired)

    def take(self, count: int) -> list[list[RolloutSample]]:
        """``count`` completed groups, removed from the buffer (sync: oldest first; async: stalest first)."""
        ready = [g for g in self.groups if g.status == "completed"]
        if self.kind == "async":
            ready.sort(key=lambda g: (g.oldest_version, g.uid))
        ready.sort(key=lambda g: g.samples[0].group_id not in self.tail_groups)  # the tail lane first (a stable sort)
        taken = ready[:count]
        for group in taken:
            self.groups.remove(group)
            if group.samples[0].group_id in self.tail_groups:
                self.tail_groups.remove(group.samples[0].group_id)
                self.tail_trained += 1
        return [group.samples for group in taken]

    def take_pending(self, count: int) -> list[list[RolloutSample]]:
        """Up to ``count`` groups to generate on, oldest first, removed from the buffer."""
        pending = [g for g in self.groups if g.status == "pending"][:count]
        for group in pending:
            self.groups.remove(group)
        return [group.samples for group in pending]

    def take_tail(self, count: int) -> list[list[RolloutSample]]:
        """Once the tail lane holds ``tail_trigger`` groups: up to ``count`` of them, oldest first, removed
        from the buffer and marked to be trained first when they come back completed; else none."""
        if count <= 0 or self.tail_trigger <= 0 or self.count("tail") < self.tail_trigger:
            return []
        tail = [g for g in self.groups if g.status == "tail"][:count]
        for group in tail:
            self.groups.remove(group)
            self.tail_groups.add(group.samples[0].group_id)
        self.tail_rounds += 1
        return [group.samples for group in tail]

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self, *, keep_generations: bool = True) -> dict[str, Any]:
        """Plain data (lake rows). Without ``keep_generations`` only the prompts are kept: a resume
        generates them again."""
        groups = []
        for group in self.groups:
            samples = [from_row(to_row(sample, "")) for sample in group.samples]  # a copy
            status = group.status
            if not keep_generations:
                reset_responses(samples)
                status = "tail" if status == "tail" else "pending"
            groups.append({"status": status, "rows": [to_row(s, "") for s in samples]})
        return {"groups": groups, "next_uid": self.next_uid, "expired_total": self.expired_total, "given_up": self.given_up,
                "tail_groups": sorted(self.tail_groups), "tail_rounds": self.tail_rounds, "tail_trained": self.tail_trained}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = []
        for uid, group in enumerate(state["groups"]):
            self.groups.append(BufferedGroup([from_row(row) for row in group["rows"]], uid, group["status"]))
        self.next_uid = max(state["next_uid"], len(self.groups))
        self.expired_total = state["expired_total"]
        self.given_up = [tuple(item) for item in state["given_up"]]
        self.tail_groups = set(state.get("tail_groups", ()))
        self.tail_rounds, self.tail_trained = state.get("tail_rounds", 0), state.get("tail_trained", 0)
