"""A batch's multi-turn figures (``agent/*``): turns per session, tool calls and their failures, and
why sessions ended. Empty for single-turn batches."""

from __future__ import annotations

from collections import Counter

from trellis.engine.data.samples import RolloutSample


def agent_summary(samples: list[RolloutSample]) -> dict[str, float]:
    sessions = [s.agent for s in samples if s.agent is not None]
    if not sessions:
        return {}
    calls = [call for agent in sessions for call in agent["tool_calls"]]
    turns = [sum(turn["role"] == "assistant" for turn in agent["turns"]) for agent in sessions]
    summary = {
        "agent/sessions": float(len(sessions)),
        "agent/assistant_turns_mean": sum(turns) / len(turns),
        "agent/tool_calls": float(len(calls)),
        "agent/tool_errors": float(sum(call["error"] is not None for call in calls)),
        "agent/tool_s_max": max((call["seconds"] or 0.0 for call in calls), default=0.0),
    }
    for reason, count in Counter(agent["stop_reason"] for agent in sessions).items():
        summary[f"agent/ended_{reason}"] = float(count)
    return summary
