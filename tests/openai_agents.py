"""Agents as a user writes them against the ``openai`` client, for the ``openai`` agent loop: each is
called as agent(task, base_url=..., api_key=...) and talks to the policy like to any server."""

import json
import time

import openai

from trellis.engine.tiny.lookup_task import lookup

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def lookup_agent(task, base_url, api_key, **sampling):
    """Call the model with the lookup tool until it answers; run its tool calls locally."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(task["messages"])
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_TOOL], **sampling).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        if not reply.message.tool_calls:
            return None  # reward.function scores the answer
        for call in reply.message.tool_calls:
            output, _ = run_lookup(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return None


def lookup_agent_with_its_own_sampling(task, base_url, api_key):
    """lookup_agent asking for sampling settings of its own, far from the run's: hot, nucleus, penalised."""
    return lookup_agent(task, base_url, api_key, temperature=1.9, top_p=0.3, seed=7, presence_penalty=2.0, frequency_penalty=2.0)


def self_scoring_lookup_agent(task, base_url, api_key):
    """As lookup_agent, reporting its own reward: 1.0 for the value of the prompt's key. A session
    whose token budget is spent before the model answers (HTTP 409, a tool output too long for what
    is left of it, say) has no answer: 0.0."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages, looked_up = list(task["messages"]), False
    for _ in range(3):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_TOOL]).choices[0]
        except openai.ConflictError:
            return 0.0
        messages.append(reply.message.model_dump(exclude_none=True))
        if not reply.message.tool_calls:
            return float(looked_up and (reply.message.content or "").strip() == task["label"])
        for call in reply.message.tool_calls:
            output, key = run_lookup(call.function.arguments)
            looked_up = looked_up or key == task["key"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return 0.0


def run_lookup(arguments: str) -> tuple[str, object]:
    """The tool's output for the model's arguments and the key it asked for; a call the model got
    wrong (a missing or extra argument, arguments that are not an object) shows it the error."""
    try:
        parsed = json.loads(arguments)
        return lookup(**parsed), parsed.get("key")
    except Exception as error:
        return f"Error: {error}", None


def raises_at_once(task, base_url, api_key):
    raise RuntimeError("the agent broke before calling the model")


def raises_after_a_call(task, base_url, api_key):
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(model="p", messages=task["messages"])
    raise KeyError("missing_field")


def sleeps_forever(task, base_url, api_key):
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(model="p", messages=task["messages"])
    time.sleep(3600)


def returns_garbage(task, base_url, api_key):
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(model="p", messages=task["messages"])
    return "great job"


def wrong_key(task, base_url, api_key):
    openai.OpenAI(base_url=base_url, api_key="sk-not-a-session", max_retries=0).chat.completions.create(model="p", messages=task["messages"])


def sends_back_a_long_tool_output(task, base_url, api_key):
    """Runs the model's first tool call and sends back an output longer than what is left of the
    session's token budget."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(task["messages"])
    reply = client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP_TOOL]).choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "output " * 60}]
    client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP_TOOL])


def talks_past_its_budget(task, base_url, api_key):
    """Keeps the conversation going with long user messages until the server refuses."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(task["messages"])
    while True:
        reply = client.chat.completions.create(model="p", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more " * 30}]


def rewrites_history(task, base_url, api_key):
    """Calls once, then drops the reply and asks something else: a second, unrelated conversation."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="p", messages=task["messages"])
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": "lookup ZZZZ"}])


def must_not_score(sample):
    raise AssertionError("the agent reported this session's reward: reward.function must not run")


def short_replies(task, base_url, api_key):
    """Caps its first reply at 2 tokens with max_tokens, then asks the model to go on."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(task["messages"])
    first = client.chat.completions.create(model="p", messages=messages, max_tokens=2).choices[0]
    assert first.finish_reason == "length", first.finish_reason
    messages += [first.message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    client.chat.completions.create(model="p", messages=messages)


def long_system_prompt(task, base_url, api_key):
    messages = [{"role": "system", "content": "be brief " * 60}, *task["messages"]]
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(model="p", messages=messages)


def returns_nan(task, base_url, api_key):
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(model="p", messages=task["messages"])
    return float("nan")
