"""The tools of an agent loop: Python callables named in the config as ``module:TOOLS`` (or
``file.py:TOOLS``), where ``TOOLS`` is a dict of name to callable, a list of callables (each named by
its ``__name__``) or a single callable. The model's arguments are passed as keywords.

Each call runs in a worker process (``BoundedCalls``), bounded by a timeout and by a memory limit on
what the call may allocate; what it prints is captured; what it returns becomes text (JSON for dicts
and lists) cut to ``max_chars``. A tool that raises, hangs, runs out of memory or returns garbage
gives the model an error message in place of its output, and never crashes or hangs the step.
"""

from __future__ import annotations

import io
import json
import resource
import time
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from typing import Any, Callable

from trellis.engine.rollout.bounded_calls import BoundedCalls
from trellis.engine.rollout.agents.tool_calls import ToolCall
from trellis.engine.secrets import redact
from trellis.engine.user_code import UserCodeError, load_attribute

_limited = False  # per worker process: its memory limit is set once


@dataclass(frozen=True)
class ToolResult:
    output: str  # what the model is shown: the tool's output, or the error message
    error: str | None = None
    seconds: float = 0.0


def load_tools(spec: str) -> dict[str, Callable[..., Any]]:
    value, _ = load_attribute(spec)
    if callable(value) and not isinstance(value, (dict, list, tuple)):
        value = [value]
    if isinstance(value, (list, tuple)):
        value = {getattr(tool, "__name__", ""): tool for tool in value}
    if not isinstance(value, dict) or not value or not all(isinstance(k, str) and k and callable(v) for k, v in value.items()):
        raise UserCodeError(f"{spec!r} must name a dict of name -> callable, a list of named callables or one callable.")
    return value


def truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... [{len(text) - max_chars} more characters cut]"


def call_tool(spec: str, name: str, arguments: dict[str, Any], memory_mb: int, max_chars: int) -> str:
    """Runs inside a worker process."""
    _limit_memory(memory_mb)
    tool = load_tools(spec)[name]
    printed = io.StringIO()
    with redirect_stdout(printed), redirect_stderr(printed):
        result = tool(**arguments)
    if result is None:
        return truncate(printed.getvalue(), max_chars)
    if isinstance(result, str):
        return truncate(result, max_chars)
    if isinstance(result, (dict, list, int, float, bool)):
        return truncate(json.dumps(result, default=str), max_chars)
    return truncate(str(result), max_chars)


def _limit_memory(memory_mb: int) -> None:
    """Allow this process ``memory_mb`` of address space beyond what it holds now (a forked worker
    already maps the parent's libraries, so an absolute limit would mean nothing)."""
    global _limited
    if _limited:
        return
    with open("/proc/self/status") as status:
        size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = size_kb * 1024 + memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    _limited = True


class ToolRunner:
    def __init__(self, spec: str, *, timeout_s: float, memory_mb: int, max_chars: int, num_workers: int) -> None:
        self.spec, self.timeout_s, self.memory_mb, self.max_chars = spec, timeout_s, memory_mb, max_chars
        self.names = sorted(load_tools(spec))  # fail at start-up on a misspelt spec
        self._calls = BoundedCalls(num_workers, timeout_s)

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """One result per call, in order; the slow and the hung cost the batch about one timeout."""
        runnable = [i for i, call in enumerate(calls) if call.error is None and call.name in self.names]
        started = time.monotonic()
        futures = self._calls.map(
            call_tool, [(self.spec, calls[i].name, calls[i].arguments, self.memory_mb, self.max_chars) for i in runnable]
        )
        seconds = time.monotonic() - started
        results = {i: self._collect(calls[i].name, future, seconds) for i, future in zip(runnable, futures)}
        return [results.get(i) or self._refused(call) for i, call in enumerate(calls)]

    def _refused(self, call: ToolCall) -> ToolResult:
        error = call.error or f"there is no tool {call.name!r}; the tools are {', '.join(self.names)}"
        return ToolResult(f"Error: {error}.", error)

    def _collect(self, name: str, future, seconds: float) -> ToolResult:
        try:
            return ToolResult(future.result(), None, seconds)
        except FutureTimeout:
            error = f"tool {name!r} timed out after {self.timeout_s:g}s"
        except MemoryError:
            error = f"tool {name!r} ran out of memory (limit {self.memory_mb} MB)"
        except Exception as exception:  # the tool raised, or its process died
            error = redact(f"tool {name!r} failed: {type(exception).__name__}: {exception}")
        error = truncate(error, self.max_chars)
        return ToolResult(f"Error: {error}", error, seconds)

    def close(self) -> None:
        self._calls.close()
