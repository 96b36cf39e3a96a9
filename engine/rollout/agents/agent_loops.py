"""Agent loops: how a batch's samples are made from their prompts.

``SingleTurnLoop`` generates one response per prompt. ``ToolLoop`` runs multi-turn sessions in which
the model calls tools, token in and token out: each turn is generated from the prompt's ids and the
session's ids so far, exactly as they were sampled (never decoded and re-tokenised, the source of
the train/rollout drift multi-turn trainers are known for); the tools' outputs are tokenised once,
appended with ``response_mask`` 0 and logprob 0, and so never trained on. The session is one
``RolloutSample`` whose ``agent`` field records its turns (token spans and text), its tool calls and
why it ended: an answer (a turn with no tool call), ``max_turns``, the token budget
(``rollout.max_new_tokens`` covers the whole session: ``finish_reason`` "length"), or an abort.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

from trellis.engine.config import AgentConfig
from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.rollout.backends.base import Generation, RolloutBackend, SamplingParams
from trellis.engine.rollout.agents.base import AgentLoop, append_turn, start_session
from trellis.engine.rollout.agents.gateway_loop import GatewayLoop
from trellis.engine.rollout.agents.generate import backend_prompt, budget_of, generate, generate_streaming
from trellis.engine.rollout.agents.tool_calls import ToolCall, parse_tool_calls
from trellis.engine.rollout.agents.tools import ToolResult, ToolRunner


class SingleTurnLoop:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode

    def run(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> None:
        generate(samples, backend, params, self._decode)

    def stream(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> Iterator[RolloutSample]:
        yield from generate_streaming(samples, backend, params, self._decode)

    def close(self) -> None:
        pass


class ToolLoop:
    def __init__(self, config: AgentConfig, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> None:
        assert config.tools is not None  # the config requires it with loop: tool
        self._config, self._encode, self._decode = config, encode, decode
        self._tools = ToolRunner(
            config.tools, timeout_s=config.tool_timeout_s, memory_mb=config.tool_memory_mb,
            max_chars=config.tool_output_max_chars, num_workers=config.tool_workers,
        )

    def run(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> None:
        for _ in self.stream(samples, backend, params):
            pass

    def stream(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> Iterator[RolloutSample]:
        """All live sessions take their next turn in one backend call; then all their tool calls run
        together, so the hung ones cost the turn about one timeout."""
        for sample in samples:
            start_session(sample, "tool", backend.policy_version)
        active, turn = list(samples), 0
        while active:
            lefts = [budget_of(s, params) - len(s.response_ids) for s in active]
            seed = None if params.seed is None else params.seed + turn
            turn_params = dataclasses.replace(params, max_new_tokens=max(lefts), seed=seed)
            generations = backend.generate([backend_prompt(s) for s in active], turn_params, lefts)
            calling: list[tuple[RolloutSample, list[ToolCall]]] = []
            for sample, generation, left in zip(active, generations, lefts):
                calls = self._add_turn(sample, generation, left, backend.policy_version)
                if calls:
                    calling.append((sample, calls))
                else:
                    yield sample
            results = iter(self._tools.run([call for _, calls in calling for call in calls]))
            active = []
            for sample, calls in calling:
                if self._add_tool_turn(sample, calls, [next(results) for _ in calls], params, backend.policy_version):
                    active.append(sample)
                else:
                    yield sample
            turn += 1

    def _add_turn(self, sample: RolloutSample, generation: Generation, left: int, version: int) -> list[ToolCall]:
        """Append an assistant turn; its tool calls if the session goes on, else [] (it has ended)."""
        ids = generation.response_ids[:left]
        text = self._decode(ids)
        append_turn(sample, ids, generation.logprobs[:left], 1, version, {"role": "assistant", "text": text})
        sample.agent["final_response"] = text
        if generation.finish_reason == "abort":
            self._end(sample, "aborted", "abort")
        elif generation.finish_reason == "length" or len(generation.response_ids) > left:
            self._end(sample, "token_budget", "length")
        else:
            calls = parse_tool_calls(text, self._config.max_calls_per_turn)
            turns = sum(turn["role"] == "assistant" for turn in sample.agent["turns"])
            if not calls:
                self._end(sample, "answer", "stop")
            elif turns >= self._config.max_turns:
                self._end(sample, "max_turns", "length")
            else:
                return calls
        return []

    def _add_tool_turn(
        self, sample: RolloutSample, calls: list[ToolCall], results: list[ToolResult], params: SamplingParams, version: int
    ) -> bool:
        """Append the tools' outputs, tokenised once; False when they leave no room for another turn."""
        config = self._config
        turn = len(sample.agent["turns"]) - 1
        for call, result in zip(calls, results):
            sample.agent["tool_calls"].append({
                "turn": turn, "name": call.name, "arguments": call.arguments, "output": result.output,
                "error": result.error, "seconds": round(result.seconds, 4),
            })
        responses = "\n".join(config.tool_response_template.format(output=result.output) for result in results)
        text = config.tool_turn_template.format(responses=responses)
        ids = self._encode(text)
        if len(ids) >= budget_of(sample, params) - len(sample.response_ids):
            self._end(sample, "token_budget", "length")
            return False
        append_turn(sample, ids, [0.0] * len(ids), 0, version, {"role": "tool", "text": text})
        return True

    def _end(self, sample: RolloutSample, reason: str, finish_reason: str) -> None:
        sample.agent["stop_reason"] = reason
        sample.finish_reason = finish_reason
        sample.status = Status.ABORTED if finish_reason == "abort" else Status.COMPLETED
        sample.response = self._decode(sample.response_ids)

    def close(self) -> None:
        self._tools.close()


def build_agent_loop(config: AgentConfig, tokenizer, max_prompt_tokens: int | None = None) -> AgentLoop:
    """``max_prompt_tokens``: the longest prompt the run trains on, for loops whose agents write their own."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    if config.loop == "single_turn":
        return SingleTurnLoop(decode)
    if config.loop == "openai":
        return GatewayLoop(config, tokenizer, max_prompt_tokens)
    return ToolLoop(config, lambda text: tokenizer.encode(text, add_special_tokens=False), decode)
