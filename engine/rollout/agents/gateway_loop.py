"""The ``openai`` agent loop: the user's own agent, written against the ``openai`` client, makes the
samples. For each sample the agent function named by ``agent.entrypoint`` is called in a thread as

    agent(task, base_url=..., api_key=...)

where ``task`` holds the prompt's ``messages``, ``label``, ``data_source``, ``task_name`` and the row's
other columns; the agent builds ``openai.OpenAI(base_url=base_url, api_key=api_key)`` and calls it as it
would any server. Every call lands in the session's sample (``engine.rollout.agents.gateway``). The agent may
return its own reward (a number), which then stands for the sample's reward; ``None`` leaves scoring
to ``reward.function``.

A session ends when its agent returns (``answer``), raises (``agent_error``, with the error kept),
starts with a prompt longer than the run's ``max_prompt_length`` (``prompt_too_long``),
returns something that is not a number (``agent_error``), runs past ``agent.session_timeout_s`` of its
own time (``timeout``: its key stops working, its thread is left to end on its own; the time its calls
wait for the model does not count, as it grows with the batch and the machine's load), or when its
token budget (``rollout.max_new_tokens``, the whole session) is spent (``token_budget``).
"""

from __future__ import annotations

import math
import queue
import threading
import traceback
from numbers import Real
from typing import Any, Iterator

from trellis.engine.config import AgentConfig
from trellis.engine.data.samples import RolloutSample
from trellis.engine.rollout.backends.base import RolloutBackend, SamplingParams
from trellis.engine.rollout.agents.chat_session import ChatSession
from trellis.engine.rollout.agents.gateway import Gateway
from trellis.engine.rollout.agents.generate import budget_of
from trellis.engine.user_code import load_function

AGENT_ERROR_MAX_CHARS = 2000


class GatewayLoop:
    def __init__(self, config: AgentConfig, tokenizer: Any, max_prompt_tokens: int | None = None) -> None:
        assert config.entrypoint is not None  # the config requires it with loop: openai
        self._config, self._tokenizer, self._max_prompt_tokens = config, tokenizer, max_prompt_tokens
        self._agent = load_function(config.entrypoint)
        self._gateway: Gateway | None = None

    @property
    def gateway(self) -> Gateway:
        if self._gateway is None:
            self._gateway = Gateway(self._tokenizer, self._config.batch_window_ms / 1000)
        return self._gateway

    def run(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> None:
        for _ in self.stream(samples, backend, params):
            pass

    def stream(self, samples: list[RolloutSample], backend: RolloutBackend, params: SamplingParams) -> Iterator[RolloutSample]:
        gateway = self.gateway
        finished: queue.Queue = queue.Queue()
        sessions = [ChatSession(s, self._tokenizer, budget_of(s, params), self._max_prompt_tokens) for s in samples]
        with gateway.serving(backend, params):
            for session in sessions:
                gateway.open(session)
            for index, session in enumerate(sessions):
                threading.Thread(target=self._run_agent, args=(index, session, finished), daemon=True, name="agent").start()
            pending = set(range(len(sessions)))
            while pending:
                left = {index: self._config.session_timeout_s - sessions[index].agent_seconds() for index in pending}
                for index in sorted(index for index, seconds in left.items() if seconds <= 0):
                    pending.discard(index)
                    yield self._time_out(sessions[index])
                if not pending:
                    break
                try:  # no pending session can run out of its own time before the soonest of them
                    index, reward, error = finished.get(timeout=min(left[index] for index in pending))
                except queue.Empty:
                    continue
                if index not in pending:
                    continue  # an agent that returned after its session timed out
                pending.discard(index)
                if error is not None:
                    sessions[index].end("agent_error")
                    sessions[index].sample.agent["error"] = error
                elif reward is not None:
                    sessions[index].sample.agent["reward"] = reward
                yield self._finish(sessions[index])

    def _run_agent(self, index: int, session: ChatSession, finished: queue.Queue) -> None:
        """Run one agent; what it returned (or why it failed) goes back to ``stream``, which alone
        touches the sample, so an agent that outlives its timeout changes nothing."""
        sample = session.sample
        task = {**sample.extra, "messages": list(sample.messages), "label": sample.label,
                "data_source": sample.data_source, "task_name": sample.task_name}
        reward, error = None, None
        try:
            returned = self._agent(task, base_url=self.gateway.base_url, api_key=session.token)
            if returned is not None and (isinstance(returned, bool) or not isinstance(returned, Real) or not math.isfinite(returned)):
                raise TypeError(f"the agent returned {type(returned).__name__} {returned!r}: return a finite number (its reward) or None")
            reward = None if returned is None else float(returned)
        except Exception as failure:
            error = "".join(traceback.format_exception_only(failure)).strip()[:AGENT_ERROR_MAX_CHARS]
        finished.put((index, reward, error))

    def _time_out(self, session: ChatSession) -> RolloutSample:
        session.end("timeout")
        session.sample.agent["error"] = (
            f"the agent ran past agent.session_timeout_s={self._config.session_timeout_s:g} of its own time "
            "(time waiting for the model's replies not counted)"
        )
        return self._finish(session)

    def _finish(self, session: ChatSession) -> RolloutSample:
        self.gateway.close_session(session)
        session.finish(lambda ids: self._tokenizer.decode(ids, skip_special_tokens=True))
        return session.sample

    def close(self) -> None:
        if self._gateway is not None:
            self._gateway.close()
            self._gateway = None
