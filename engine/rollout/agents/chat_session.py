"""One agent session seen through the OpenAI-compatible gateway, kept token in and token out.

An agent resends its whole conversation on every call. The gateway never re-tokenises what the model
generated: a call that extends the previous one (the same messages, then the assistant reply it was
given, then new messages) continues the session's token ids, and only the new messages are rendered
by the chat template and tokenised; they enter the response with ``response_mask`` 0. The text the
template puts after an assistant turn's end token (Qwen's newline) is taken from the template too, so
the ids are what a fresh rendering of the conversation would give wherever the model did not write.

A call that does not extend the session (the agent edited or dropped earlier messages) is still served,
from a fresh rendering, but the session's trained sequence ends before it: ``stop_reason``
"history_rewritten".
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from typing import Any, Iterator

from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.rollout.agents.base import append_turn, start_session


class SessionEnded(Exception):
    """A call on a session that has ended (its budget spent, timed out, or closed)."""


class ChatSession:
    def __init__(self, sample: RolloutSample, tokenizer: Any, budget: int, max_prompt_tokens: int | None = None) -> None:
        self.sample, self.budget, self.token = sample, budget, "sess-" + secrets.token_urlsafe(18)
        self.max_prompt_tokens = max_prompt_tokens  # the run's max_prompt_length: what its trainer packs
        self._tokenizer = tokenizer
        self._messages: list[dict[str, Any]] | None = None  # the last call's messages + the reply given
        self._tools: Any = None
        self.recording = True  # False once the trained sequence has ended; calls are still served
        self.closed = False  # the sample is handed on: nothing touches it any more
        self._lock = threading.Lock()  # calls arrive on the server's thread, the end on the loop's
        self._opened_at = time.monotonic()
        self._served_s = 0.0  # time its calls spent being served (the union of their spans): not the agent's
        self._calls_in_flight = 0
        self._serving_since = 0.0  # when the calls now in flight began being served
        start_session(sample, "openai", calls=[])

    def agent_seconds(self) -> float:
        """The agent's own time since the session opened: the time its calls spent waiting for the
        policy does not count, since it grows with the batch, the backend and the machine's load,
        none of which the agent controls (``agent.session_timeout_s`` bounds this)."""
        with self._lock:
            now = time.monotonic()
            waiting = self._served_s + (now - self._serving_since if self._calls_in_flight else 0.0)
            return now - self._opened_at - waiting

    @contextlib.contextmanager
    def served(self) -> Iterator[None]:
        """Around a call that the policy serves for the trained sequence; calls made after it ended
        (history rewritten, say) are the agent's own business and stay on its clock."""
        with self._lock:
            counted = self.recording and not self.closed
            if counted:
                if self._calls_in_flight == 0:
                    self._serving_since = time.monotonic()
                self._calls_in_flight += 1
        try:
            yield
        finally:
            if counted:
                with self._lock:
                    self._calls_in_flight -= 1
                    if self._calls_in_flight == 0:
                        self._served_s += time.monotonic() - self._serving_since

    def prompt_for(self, messages: list[dict[str, Any]], tools: Any) -> tuple[list[int], int]:
        """The ids to generate from and how many new tokens the session's budget still allows."""
        with self._lock:
            return self._prompt_for(messages, tools)

    def _prompt_for(self, messages: list[dict[str, Any]], tools: Any) -> tuple[list[int], int]:
        if self.closed or self.sample.agent["stop_reason"] in ("token_budget", "timeout", "aborted", "prompt_too_long"):
            raise SessionEnded(f"session ended: {self.sample.agent['stop_reason']}")
        if self._messages is None:
            ids = self._render(messages, tools, generation_prompt=True)
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                self.end("prompt_too_long")
                raise SessionEnded(f"the first prompt has {len(ids)} tokens, over the run's max_prompt_length {self.max_prompt_tokens}")
            self.sample.messages, self.sample.prompt_ids, self._tools = list(messages), ids, tools
        elif self.recording and self._extends(messages, tools):
            self._append_context(messages)
        elif self.recording:
            self.end("history_rewritten")
        if not self.recording:
            return self._render(messages, tools, generation_prompt=True), self.budget
        self._messages = list(messages)
        return self.sample.prompt_ids + self.sample.response_ids, self.budget - len(self.sample.response_ids)

    def record(
        self, ids: list[int], logprobs: list[float], text: str, finish_reason: str, version: int, reply: dict, budget_spent: bool
    ) -> None:
        """The model's reply to the call ``prompt_for`` prepared; ``reply`` is the message the agent gets."""
        with self._lock:
            if not self.closed:
                self._record(ids, logprobs, text, finish_reason, version, reply, budget_spent)

    def _record(
        self, ids: list[int], logprobs: list[float], text: str, finish_reason: str, version: int, reply: dict, budget_spent: bool
    ) -> None:
        sample = self.sample
        sample.agent["calls"].append({"completion_tokens": len(ids), "finish_reason": finish_reason})
        if not self.recording:
            return
        self._messages.append(reply)
        append_turn(sample, ids, logprobs, 1, version, {"role": "assistant", "text": text})
        turn = len(sample.agent["turns"]) - 1
        for call in reply.get("tool_calls", []):
            sample.agent["tool_calls"].append({
                "turn": turn, "id": call["id"], "name": call["function"]["name"],
                "arguments": json.loads(call["function"]["arguments"]), "output": None, "error": None, "seconds": None,
            })
        sample.agent["final_response"] = text
        sample.policy_version = min(sample.response_versions)
        if finish_reason == "abort":
            self.end("aborted", finish_reason="abort")
        elif budget_spent:
            self.end("token_budget", finish_reason="length")

    def end(self, reason: str, finish_reason: str = "stop") -> None:
        """Stop the trained sequence here (the first reason sticks)."""
        sample = self.sample
        if sample.agent["stop_reason"] is None:
            sample.agent["stop_reason"], sample.finish_reason = reason, finish_reason
            if finish_reason == "abort":
                sample.status = Status.ABORTED
        self.recording = False

    def finish(self, decode) -> None:
        """The agent has returned: fill in what the lake and the reward function read."""
        sample = self.sample
        with self._lock:
            self.closed = True
        self.end("answer")
        if not sample.agent["calls"]:
            sample.fail(sample.agent.get("error") or "the agent made no call to the model")
        sample.response = decode(sample.response_ids)

    def _extends(self, messages: list[dict[str, Any]], tools: Any) -> bool:
        previous = self._messages
        if tools != self._tools or len(messages) <= len(previous) or messages[: len(previous) - 1] != previous[:-1]:
            return False
        given, returned = messages[len(previous) - 1], previous[-1]
        return given.get("role") == "assistant" and (given.get("content") or "").strip() == (returned.get("content") or "").strip()

    def _append_context(self, messages: list[dict[str, Any]]) -> None:
        """Tokenise the messages after the assistant reply, and the template's text closing that reply;
        raise ``SessionEnded`` where they leave no room in the budget for the model's next reply."""
        before = self._render_text(messages[: len(self._messages)], self._tools, generation_prompt=False)
        after = self._render_text(messages, self._tools, generation_prompt=True)
        if not after.startswith(before):
            self.end("history_rewritten")  # a template that renders earlier turns differently later on
            return
        eos = self._tokenizer.eos_token or ""
        ended_on_eos = self.sample.response_ids[-1:] == [self._tokenizer.eos_token_id]
        at = before.rfind(eos) if eos else -1
        closing = before[at + len(eos):] if ended_on_eos and at >= 0 else (before[at:] if at >= 0 else "")
        self._record_tool_outputs(messages[len(self._messages):])
        text = closing + after[len(before):]
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= self.budget - len(self.sample.response_ids):
            # As in the tool loop: messages that leave the model no token of the budget end the session
            # without them, so the trained sequence never outgrows rollout.max_new_tokens.
            self.end("token_budget", finish_reason="length")
            raise SessionEnded(
                f"session ended: token_budget (the new messages take {len(ids)} tokens; "
                f"{self.budget - len(self.sample.response_ids)} are left of the session's {self.budget})"
            )
        append_turn(self.sample, ids, [0.0] * len(ids), 0, self.sample.response_versions[-1], {"role": "context", "text": text})

    def _record_tool_outputs(self, new_messages: list[dict[str, Any]]) -> None:
        """The agent ran the model's tool calls itself: their outputs are what it sends back."""
        calls = {call["id"]: call for call in self.sample.agent["tool_calls"] if call["output"] is None}
        for message in new_messages:
            call = calls.get(message.get("tool_call_id")) if message.get("role") == "tool" else None
            if call is not None:
                call["output"] = message.get("content")

    def _render_text(self, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _render(self, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> list[int]:
        text = self._render_text(messages, tools, generation_prompt)
        return self._tokenizer.encode(text, add_special_tokens=False)

