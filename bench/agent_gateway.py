"""What the openai agent loop costs against the built-in tool loop on the same sessions: 128 lookup
sessions (16 prompts x 8, T=0.6, 40 new tokens) of the warmed-up lookup model (build/lookup), made by
the tool loop, by an agent that builds its ``openai.OpenAI`` client per session (as an unchanged agent
does), and by one that shares a client across sessions (``with_options(api_key=...)``); alternating,
median of ``--rounds``. The figure is the batch's wall time, the ``produce_batch`` a user waits on.

    .venv/bin/trellis tiny-model build/lookup --task lookup
    .venv/bin/python bench/agent_gateway.py [--rounds 3] [--out bench/results/agent_gateway.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import openai
import typer
from transformers import AutoTokenizer

from trellis.engine.config import AgentConfig
from trellis.engine.data.samples import RolloutSample
from trellis.engine.rollout.agents.agent_loops import build_agent_loop
from trellis.engine.rollout.backends.base import SamplingParams
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
from trellis.engine.tiny import lookup_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from openai_agents import LOOKUP_TOOL, lookup_agent  # noqa: E402

SHARED = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="unused", max_retries=0)


def shared_client_agent(task, base_url, api_key):
    """lookup_agent's logic on one process-wide client: no TLS context and connection pool per session."""
    client = SHARED.with_options(base_url=base_url, api_key=api_key)
    messages = list(task["messages"])
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_TOOL]).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        if not reply.message.tool_calls:
            return None
        for call in reply.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": lookup_task.lookup(**json.loads(call.function.arguments))})
    return None


def samples(tokenizer, round_index: int) -> list[RolloutSample]:
    out = []
    for index, row in enumerate(lookup_task.make_rows(16, seed=100 + round_index)):
        messages = [{"role": "user", "content": row["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        for k in range(8):
            out.append(RolloutSample(
                rollout_id=f"{index}-{k}", group_id=str(index), session_id=f"{index}-{k}", prompt_index=index,
                messages=messages, prompt_ids=ids, label=row["label"], data_source="lookup", task_name="lookup",
                extra={"key": row["key"]},
            ))
    return out


def main(model: Path = Path("build/lookup"), rounds: int = 3, out: Path = Path("bench/results/agent_gateway.json")) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model)
    backend = TransformersRollout(str(model), tokenizer)
    loops = {
        "tool_loop": build_agent_loop(AgentConfig(loop="tool", tools="trellis.engine.tiny.lookup_task:TOOLS", max_turns=3), tokenizer),
        "openai_client_per_session": build_agent_loop(AgentConfig(loop="openai", entrypoint=f"{__file__}:lookup_agent_here"), tokenizer),
        "openai_shared_client": build_agent_loop(AgentConfig(loop="openai", entrypoint=f"{__file__}:shared_client_agent"), tokenizer),
    }
    params = SamplingParams(max_new_tokens=40, temperature=0.6, seed=1)
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    batches: dict[str, list[int]] = {}
    for round_index in range(rounds + 1):  # round 0 warms up
        for name, loop in loops.items():
            batch = samples(tokenizer, round_index)
            started = time.perf_counter()
            loop.run(batch, backend, params)
            if round_index:
                seconds[name].append(time.perf_counter() - started)
            if hasattr(loop, "gateway"):
                batches[name] = list(loop.gateway.batcher.batch_sizes)
    for loop in loops.values():
        loop.close()
    result = {name: {"batch_s_median": statistics.median(values), "batch_s": values} for name, values in seconds.items()}
    for name in ("openai_client_per_session", "openai_shared_client"):
        result[name]["ratio_vs_tool_loop"] = result[name]["batch_s_median"] / result["tool_loop"]["batch_s_median"]
        result[name]["generate_calls_last_round"] = batches.get(name)
    result["setup"] = "128 lookup sessions (16 prompts x 8), T=0.6, 40 new tokens per session, transformers backend, 2 CPU cores"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


lookup_agent_here = lookup_agent

if __name__ == "__main__":
    typer.run(main)
