"""Structured output through the official `openai` client: `response_format` with a JSON
schema (written by hand, and made by the client from a pydantic model with `parse`), and
`json_object`. Run through tests/python/run.sh (see test_openai_client.py)."""

import json
from typing import Literal

import openai
import pydantic
import pytest


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "editor", "viewer"]


ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def test_parse_with_a_pydantic_model_gives_a_valid_instance(client, model):
    # The client turns Person into a strict json_schema response_format and validates the reply.
    for seed, temperature in [(0, 0.0), (1, 0.8), (2, 1.0)]:
        reply = client.chat.completions.parse(
            model=model,
            messages=ASK,
            response_format=Person,
            max_tokens=80,
            temperature=temperature,
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person)


def test_json_schema_streamed_equals_whole(client, model):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "strict": True, "schema": Person.model_json_schema()},
    }
    whole = client.chat.completions.create(
        model=model, messages=ASK, response_format=fmt, max_tokens=80, temperature=0
    )
    text = whole.choices[0].message.content
    Person.model_validate_json(text)
    stream = client.chat.completions.create(
        model=model, messages=ASK, response_format=fmt, max_tokens=80, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


def test_json_object_on_chat_and_completions(client, model):
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give a small JSON object with a cat's name and age."}],
        response_format={"type": "json_object"},
        max_tokens=160,
        temperature=0,
    )
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(
        model=model,
        prompt="A cat, as JSON:",
        max_tokens=160,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_an_unenforceable_strict_schema_is_a_400_naming_it(client, model):
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "ids",
            "strict": True,
            "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        },
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, response_format=fmt)
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert "uniqueItems" in err.value.body["message"]
