"""What every agent loop is: a way to make a batch's samples from their prompts (``AgentLoop``), and
the session record a multi-turn loop writes into a sample (``start_session``, ``append_turn``). The
loops, the gateway's sessions and batch production all build on it; it builds on none of them."""

from __future__ import annotations

import time
from typing import Iterator, Protocol

from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.rollout.backends.base import RolloutBackend, SamplingParams


class AgentLoop(Protocol):
    def run(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> None: ...

    def stream(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> Iterator[RolloutSample]:
        """As ``run``, yielding each sample as soon as it has ended."""
        ...

    def close(self) -> None: ...


def start_session(sample: RolloutSample, loop: str, version: int | None = None, **record: list) -> None:
    """A fresh session for ``sample`` (one interrupted earlier starts over: its tools may have had
    effects): no response, no reward, and an empty ``agent`` record with the loop's own ``record`` lists."""
    sample.response_ids, sample.logprobs, sample.response_mask, sample.response_versions = [], [], [], []
    if version is not None:
        sample.policy_version = version
    sample.reward, sample.reward_payload = None, {}
    sample.status, sample.finish_reason, sample.error = Status.COMPLETED, "", None
    sample.agent = {"loop": loop, "turns": [], "tool_calls": [], **record, "stop_reason": None, "final_response": ""}
    sample.timings = [t for t in sample.timings if t[0] != "agent.turn"] + [("agent.session", time.time(), time.time(), {"loop": loop})]


def append_turn(sample: RolloutSample, ids: list[int], logprobs: list[float], mask: int, version: int, turn: dict) -> None:
    """Append a turn's ids to the response, with its logprobs, loss mask and token span."""
    start = len(sample.response_ids)
    sample.response_ids = sample.response_ids + list(ids)
    sample.logprobs = sample.logprobs + list(logprobs)
    sample.response_mask = (sample.response_mask or []) + [mask] * len(ids)
    sample.response_versions = sample.response_versions + [version] * len(ids)
    sample.agent["turns"].append({**turn, "start": start, "end": len(sample.response_ids)})
    since = max((t[2] for t in sample.timings if t[0] in ("agent.session", "agent.turn")), default=time.time())
    sample.timings.append(("agent.turn", since, time.time(), {"turn": len(sample.agent["turns"]) - 1, "role": turn.get("role", ""), "tokens": len(ids)}))
