"""Tool calls through the official `openai` and `anthropic` clients: forced calls
(`tool_choice` required / a named function; Anthropic `any` / `tool`), the round trip with the
tool's answer, streamed calls reassembled by the client, and arguments the client validates
against the function's schema. Run through tests/python/run.sh (SmolLM2: its template has no
tools branch, so the fallback prompt and the grammar make the call)."""

import json
import os

import anthropic
import openai
import pydantic
import pytest

BASE_URL = os.environ["SPECULA_BASE_URL"]
QUESTION = "What is 17 plus 25? Also, how is the weather in Paris?"


class Add(pydantic.BaseModel):
    """Add two integers."""

    a: int
    b: int


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = openai.pydantic_function_tool(Add, name="add")
TOOLS = [WEATHER, ADD]


def valid(name, arguments):
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    if name == "add":
        return set(args) == {"a", "b"} and all(isinstance(args[k], int) for k in "ab")
    if name == "get_weather":
        return set(args) == {"city"} and isinstance(args["city"], str)
    return False


def ask(client, model, **kwargs):
    args = dict(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        tools=TOOLS,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    args.update(kwargs)
    return client.chat.completions.create(**args)


def test_required_call_then_the_tool_answer_then_the_reply(client, model):
    reply = ask(client, model, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in {"add", "get_weather"}
    assert valid(call.function.name, call.function.arguments), call.function.arguments

    # The round trip: the assistant's call and the tool's answer go back as the client sends
    # them; the model answers in text.
    messages = [
        {"role": "user", "content": QUESTION},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=24
    )
    assert answer.choices[0].finish_reason in {"stop", "length"}
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens


def test_named_function_parsed_by_the_client(client, model):
    # `parse` checks the arguments against the strict pydantic schema of `add`.
    reply = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "add"
    assert isinstance(call.function.parsed_arguments, Add)


def test_streamed_call_reassembles_to_the_whole_one(client, model):
    whole = ask(client, model, tool_choice="required").choices[0].message.tool_calls[0]
    calls, finish = {}, None
    for chunk in ask(client, model, tool_choice="required", stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                if d.function is not None:
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == whole.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)


def test_forced_call_and_response_format_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, model, tool_choice="required", response_format={"type": "json_object"})
    assert "response_format" in str(err.value)


# Anthropic: the same through /v1/messages.

ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


@pytest.fixture(scope="module")
def claude():
    return anthropic.Anthropic(base_url=BASE_URL, api_key="unused")


def message(claude, model, **kwargs):
    args = dict(
        model=model,
        max_tokens=80,
        messages=[{"role": "user", "content": QUESTION}],
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    args.update(kwargs)
    return args


def test_anthropic_tool_use_then_tool_result(claude, model):
    msg = claude.messages.create(**message(claude, model))
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name in {"add", "get_weather"}
    assert valid(use.name, use.input), use.input

    named = claude.messages.create(**message(claude, model, tool_choice={"type": "tool", "name": "add"}))
    assert [b.name for b in named.content if b.type == "tool_use"][:1] == ["add"]

    # The round trip: the tool_use block goes back as the client sends it, the result as a
    # tool_result block (content as a list of text blocks).
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "42"}]}
            ],
        },
    ]
    answer = claude.messages.create(
        **message(claude, model, messages=history, tool_choice={"type": "auto"}, max_tokens=24)
    )
    assert answer.stop_reason in {"end_turn", "max_tokens"}
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.usage.input_tokens > msg.usage.input_tokens


def test_anthropic_stream_gives_the_whole_message(claude, model):
    whole = claude.messages.create(**message(claude, model))
    with claude.messages.stream(**message(claude, model)) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content
    ]
    assert final.usage.output_tokens == whole.usage.output_tokens
