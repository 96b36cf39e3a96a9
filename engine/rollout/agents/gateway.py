"""An OpenAI-compatible chat completions endpoint on the rollout side, for agents written against the
``openai`` client: ``POST {base_url}/chat/completions`` with the session's key as the API key.

Each call is served from the policy being trained, and its exact token ids and logprobs go into the
session's sample (``engine.rollout.agents.chat_session``). Calls from all live sessions are gathered for
``agent.batch_window_ms`` and generated in one backend call. The server listens on 127.0.0.1 only, on
a free port; a key is a random token valid for one session, so a call cannot land in another's.

Sampling follows the run (``rollout.temperature``, ``top_p``, ``top_k``): a request's own sampling
settings are ignored, since the trainer's logprobs must match the distribution the tokens came from.
``max_tokens`` / ``max_completion_tokens`` are honoured within the session's token budget; ``stream``
and ``n`` > 1 are refused (HTTP 400), and the session goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from trellis.engine.rollout.backends.base import RolloutBackend, SamplingParams
from trellis.engine.rollout.agents.chat_session import ChatSession, SessionEnded
from trellis.engine.rollout.agents.generation_batcher import GenerationBatcher
from trellis.engine.rollout.agents.tool_calls import OPEN, parse_tool_calls

logger = logging.getLogger(__name__)
MODEL_NAME = "policy"


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # temperature, top_p, ...: accepted, and ignored (see above)

    messages: list[dict[str, Any]]
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False
    logprobs: bool = False


class Gateway:
    def __init__(self, tokenizer: Any, batch_window_s: float) -> None:
        self._tokenizer = tokenizer
        self._sessions: dict[str, ChatSession] = {}
        self._lock = threading.Lock()
        self.batcher = GenerationBatcher(batch_window_s)
        self._server, self._thread, self.base_url = _serve(self._app())

    def open(self, session: ChatSession) -> None:
        with self._lock:
            self._sessions[session.token] = session

    def close_session(self, session: ChatSession) -> None:
        with self._lock:
            self._sessions.pop(session.token, None)

    def serving(self, backend: RolloutBackend, params: SamplingParams):
        return self.batcher.serving(backend, params)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.batcher.close()

    def _app(self) -> FastAPI:
        app = FastAPI(title="trellis rollout gateway", openapi_url=None, docs_url=None, redoc_url=None)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "trellis"}]}

        @app.post("/v1/chat/completions")
        async def chat_completions(request: ChatRequest, authorization: str | None = Header(None)):
            return await self._complete(request, authorization)

        return app

    async def _complete(self, request: ChatRequest, authorization: str | None):
        token = (authorization or "").removeprefix("Bearer ").strip()
        with self._lock:
            session = self._sessions.get(token)
        if session is None:
            return _error(401, "unknown or expired session key: use the api_key your agent was given for this session")
        with session.served():
            return await self._serve_call(session, request)

    async def _serve_call(self, session: ChatSession, request: ChatRequest):
        if request.stream:
            return _error(400, "stream=true is not supported: this endpoint answers each call whole; call it without stream")
        if request.n != 1:
            return _error(400, f"n={request.n} is not supported: this endpoint makes one choice per call (n=1); call it again for more")
        try:
            prompt_ids, left = session.prompt_for(request.messages, request.tools)
        except SessionEnded as ended:
            return _error(409, str(ended))
        except Exception as error:  # a chat template that cannot render these messages
            return _error(400, f"cannot render the messages with the model's chat template: {error}")
        asked = request.max_completion_tokens or request.max_tokens
        limit = min(left, asked) if asked else left
        try:
            generation = await asyncio.wrap_future(self.batcher.submit(prompt_ids, limit))
        except Exception as error:
            return _error(500, f"generation failed: {error}")
        ids = generation.response_ids[:limit]
        text = self._tokenizer.decode(ids, skip_special_tokens=True)
        finish = "length" if len(generation.response_ids) > limit else generation.finish_reason
        message = _message(text, with_tools=request.tools is not None)
        # A reply cut by the request's own max_tokens leaves the session going; one cut by its budget ends it.
        budget_spent = finish == "length" and limit >= left
        session.record(ids, generation.logprobs[:limit], text, finish, self.batcher.policy_version, message, budget_spent)
        choice = {"index": 0, "message": message, "finish_reason": _openai_finish(finish, message)}
        if request.logprobs:
            tokens = self._tokenizer.convert_ids_to_tokens(ids)
            choice["logprobs"] = {"content": [
                {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in zip(tokens, generation.logprobs[:limit])
            ]}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model or MODEL_NAME, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": len(prompt_ids) + len(ids)},
        }


def _message(text: str, with_tools: bool) -> dict[str, Any]:
    """The assistant message; with ``tools`` in the request, Hermes ``<tool_call>`` blocks become
    OpenAI ``tool_calls`` (an unreadable block stays in the content, for the agent to see)."""
    calls = parse_tool_calls(text) if with_tools else []
    readable = [call for call in calls if call.error is None]
    if not readable:
        return {"role": "assistant", "content": text}
    content = text[: text.index(OPEN)].strip() if all(call.error is None for call in calls) else text
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for call in readable
        ],
    }


def _openai_finish(finish: str, message: dict[str, Any]) -> str:
    if "tool_calls" in message:
        return "tool_calls"
    return {"stop": "stop", "length": "length"}.get(finish, "stop")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": "invalid_request_error"}})


def _serve(app: FastAPI) -> tuple[uvicorn.Server, threading.Thread, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rollout-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the rollout gateway's HTTP server did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

