"""Tool calls in the Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one or more per assistant turn. A turn with no ``<tool_call>`` is an answer; one whose call cannot be
read gets the reason, which the model is then shown as the tool's output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call could not be read (then name and arguments are empty)


def parse_tool_calls(text: str, max_calls: int = 8) -> list[ToolCall]:
    """The calls of one assistant turn, in order (at most ``max_calls``); [] for an answer."""
    if OPEN not in text:
        return []
    calls = [_parse_one(body) for body in _CALL.findall(text)[:max_calls]]
    if text.count(OPEN) > text.count(CLOSE):
        calls.append(ToolCall(error=f"a {OPEN} has no closing {CLOSE}"))
    return calls[:max_calls]


def _parse_one(body: str) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(error=f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(error='the tool call must be a JSON object with a "name" string')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models put the arguments in as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=payload["name"], error='"arguments" must be a JSON object')
    return ToolCall(name=payload["name"], arguments=arguments)
