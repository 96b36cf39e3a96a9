"""The multi-turn tool loop, token in and token out, on a real model, real tools in worker processes
and the trainer's own sequence building.

The tiny model is first taught one session by heart (greedy decoding then replays it): call ``echo``
with "A", read the output, call it with "B", answer "AB". That gives a real 3-turn session to check
token for token, and a policy that calls a tool on cue for the bad-tool cases."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.engine.algo.losses import token_logprobs
from trellis.engine.config import AgentConfig
from trellis.engine.data.prepare import IGNORE, build_sequence
from trellis.engine.data.samples import RolloutSample
from trellis.engine.rollout.agents.agent_loops import ToolLoop, build_agent_loop
from trellis.engine.rollout.backends.base import SamplingParams
from trellis.engine.rollout.agents.tool_calls import parse_tool_calls
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
from trellis.engine.user_code import UserCodeError

CALL = '<tool_call>{"name":"echo","arguments":{"text":"%s"}}</tool_call><|im_end|>'
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n%s\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
SESSION = CALL % "A" + TOOL_TURN % "A" + CALL % "B" + TOOL_TURN % "B" + "AB<|im_end|>"
GREEDY = SamplingParams(max_new_tokens=240, temperature=0.0)


@pytest.fixture(scope="module")
def echo_model(tiny_model, tmp_path_factory):
    """The tiny model, taught SESSION for the prompt "echo AB"."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    prompt = prompt_ids(tokenizer)
    response = tokenizer.encode(SESSION, add_special_tokens=False)
    ids, labels = torch.tensor([prompt + response]), torch.tensor([[-100] * len(prompt) + response])
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(200):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = tmp_path_factory.mktemp("echo") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prompt_ids(tokenizer):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "echo AB"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def session_samples(tokenizer, count=1):
    return [
        RolloutSample(
            rollout_id=f"s{i}", group_id="g", session_id=f"s{i}", prompt_index=0,
            messages=[{"role": "user", "content": "echo AB"}], prompt_ids=prompt_ids(tokenizer), label="AB",
            data_source="echo", task_name="echo",
        )
        for i in range(count)
    ]


class RecordingBackend:
    """The real backend, with each call's generations kept for comparison."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    @property
    def policy_version(self):
        return self.backend.policy_version

    def generate(self, prompts, params, limits=None):
        generations = self.backend.generate(prompts, params, limits)
        self.calls.append(generations)
        return generations


def run_sessions(echo_model, tools="agent_tools:TOOLS", count=1, params=GREEDY, **agent):
    tokenizer = AutoTokenizer.from_pretrained(echo_model)
    loop = build_agent_loop(AgentConfig(loop="tool", tools=tools, **agent), tokenizer)
    backend = RecordingBackend(TransformersRollout(str(echo_model), tokenizer))
    samples = session_samples(tokenizer, count)
    try:
        loop.run(samples, backend, params)
    finally:
        loop.close()
    return samples, backend, tokenizer


def test_a_three_turn_session_is_trained_on_exactly_the_tokens_generated_and_the_tool_outputs(echo_model):
    [session], backend, tokenizer = run_sessions(echo_model)
    agent = session.agent
    assert agent["stop_reason"] == "answer" and agent["final_response"] == "AB"
    assert [turn["role"] for turn in agent["turns"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [(c["name"], c["arguments"], c["output"], c["error"]) for c in agent["tool_calls"]] == [
        ("echo", {"text": "A"}, "A", None), ("echo", {"text": "B"}, "B", None)
    ]
    generated = [call[0].response_ids for call in backend.calls]
    tool_ids = [tokenizer.encode(TOOL_TURN % letter, add_special_tokens=False) for letter in "AB"]
    expected = generated[0] + tool_ids[0] + generated[1] + tool_ids[1] + generated[2]
    assert session.response_ids == expected
    assert session.response_mask == [1] * len(generated[0]) + [0] * len(tool_ids[0]) + [1] * len(generated[1]) + [
        0
    ] * len(tool_ids[1]) + [1] * len(generated[2])
    # Re-tokenising the decoded session would not give these ids back in general; here it must not be needed.
    sequence = build_sequence(session, advantage=1.0)
    assert sequence.input_ids == session.prompt_ids + session.response_ids[:-1]
    trained = [label for label in sequence.labels if label != IGNORE]
    assert trained == [t for t, keep in zip(session.response_ids, session.response_mask) if keep]

    model = AutoModelForCausalLM.from_pretrained(echo_model)
    with torch.no_grad():
        recomputed = token_logprobs(
            model(input_ids=torch.tensor([sequence.input_ids])).logits, torch.tensor([sequence.labels]), temperature=1.0
        )[0]
    labelled = torch.tensor(sequence.labels) != IGNORE
    rollout = torch.tensor(sequence.rollout_logprobs)
    assert (recomputed[labelled] - rollout[labelled]).abs().max() < 2e-4
    assert rollout[~labelled].abs().max() == 0.0  # tool tokens carry no rollout logprob


@pytest.mark.parametrize(
    "tools, expected_error",
    [
        ("agent_tools:RAISES", "ValueError: no echo for 'A' today"),
        ("agent_tools:HANGS", "timed out after 1s"),
        ("agent_tools:HOGS", "ran out of memory"),
        ("agent_tools:GARBAGE", "RuntimeError: this object cannot be shown"),
        ("agent_tools:OTHER_NAME", "there is no tool 'echo'"),
    ],
)
def test_a_bad_tool_shows_the_model_an_error_and_the_session_ends_with_a_reason(echo_model, tools, expected_error):
    sessions, _, _ = run_sessions(echo_model, tools, count=3, tool_timeout_s=1.0, tool_memory_mb=256)
    for session in sessions:
        first = session.agent["tool_calls"][0]
        assert expected_error in first["error"] and first["output"].startswith("Error: ")
        assert session.agent["stop_reason"] in ("answer", "max_turns", "token_budget")
        assert len(session.response_mask) == len(session.response_ids) == len(session.logprobs)


def test_a_tool_that_prints_ten_megabytes_is_cut_to_the_output_limit(echo_model):
    [session], _, _ = run_sessions(echo_model, "agent_tools:FLOODS", tool_output_max_chars=100)
    first = session.agent["tool_calls"][0]
    assert first["error"] is None and first["output"].startswith("x" * 100) and "more characters cut" in first["output"]
    assert len(first["output"]) < 200


def test_a_session_past_its_token_budget_ends_without_the_tool_turn_that_does_not_fit(echo_model):
    first_turn = len(AutoTokenizer.from_pretrained(echo_model).encode(CALL % "A", add_special_tokens=False))
    budget = SamplingParams(max_new_tokens=first_turn + 5, temperature=0.0)
    [session], _, _ = run_sessions(echo_model, params=budget)
    assert session.agent["stop_reason"] == "token_budget" and session.finish_reason == "length"
    assert len(session.response_ids) == first_turn and session.response_mask == [1] * first_turn
    assert len(session.agent["tool_calls"]) == 1  # called, but its output had no room


def test_the_turn_limit_ends_a_session_still_calling_tools(echo_model):
    [session], _, _ = run_sessions(echo_model, max_turns=2)
    assert session.agent["stop_reason"] == "max_turns" and session.finish_reason == "length"
    assert [turn["role"] for turn in session.agent["turns"]] == ["assistant", "tool", "assistant"]


def test_tool_calls_are_read_in_the_hermes_format_and_malformed_ones_say_why():
    [call] = parse_tool_calls('x <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert (call.name, call.arguments, call.error) == ("f", {"a": 1}, None)
    assert parse_tool_calls("the answer is 4") == []
    assert "not valid JSON" in parse_tool_calls("<tool_call>{name: f}</tool_call>")[0].error
    assert "no closing" in parse_tool_calls('<tool_call>{"name": "f"}')[0].error
    assert '"name" string' in parse_tool_calls('<tool_call>["f"]</tool_call>')[0].error
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')[0].arguments == {"a": 2}
    assert len(parse_tool_calls('<tool_call>{"name": "f"}</tool_call>' * 9, max_calls=4)) == 4


def test_the_tool_loop_refuses_tools_it_cannot_load_before_any_session_starts():
    with pytest.raises(UserCodeError, match="dict of name -> callable"):
        ToolLoop(AgentConfig(loop="tool", tools="agent_tools:NOT_TOOLS"), str.split, str)
    with pytest.raises(UserCodeError, match="defines no 'MISSING'"):
        ToolLoop(AgentConfig(loop="tool", tools="agent_tools:MISSING"), str.split, str)
    with pytest.raises(ValueError, match="set both agent.loop: tool and agent.tools"):
        AgentConfig(tools="agent_tools:TOOLS")
